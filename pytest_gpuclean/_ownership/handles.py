"""Who in the pytest process still holds a process's handle (an unwaited object whose ``pid``/``_pid``
names it): evidence that it is managed, not stray (docs/ownership.md, "Managed processes").

A running thread of the standard library's own is bookkeeping wherever found (asyncio's child watcher, in
pytest-asyncio's session fixture, keeps one per child), so the module and fixture walks never enter one; a
thread that runs the suite's or a library's code is walked like any object. No user code runs: attributes are
read through the interpreter's descriptors."""

from __future__ import annotations

import gc
import os
import sys
import types
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from fnmatch import fnmatch
from typing import Any, Literal, cast

HolderKind = Literal["module", "fixture", "bookkeeping"]


Holder = tuple[HolderKind, str, str]
"""What holds a handle: the root's kind and name, and the handle's type (``module.qualname``)."""


_SKIPPED_PACKAGES = ("_pytest", "pytest", "pluggy", "xdist", "execnet", "pytest_gpuclean", "py")
"""Never walked, nor their modules used as roots: the session holds the items, which hold every function
fixture's value."""
_SKIPPED_MODULES = frozenset({"sys", "gc", "builtins", "__main__", "__mp_main__"})
_BOOKKEEPING: dict[str, tuple[str, ...]] = {
    "subprocess": ("_active",),
    "threading": ("_active", "_limbo", "_dangling", "_shutdown_locks"),
    "multiprocessing.process": ("_children", "_dangling"),
    "multiprocess.process": ("_children", "_dangling"),
    "multiprocessing.util": ("_finalizer_registry", "_afterfork_registry"),
    "multiprocess.util": ("_finalizer_registry", "_afterfork_registry"),
    "concurrent.futures.process": ("_threads_wakeups",),
    "concurrent.futures.thread": ("_threads_queues",),
}
"""The standard library's records of every process and thread it started (module: attributes)."""
_PID_NAMES = ("pid", "_pid")
_ATOMS = (str, bytes, float, bool, type(None), complex)
_NOT_WALKED = (types.FrameType, types.CodeType, types.TracebackType, types.ModuleType)
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_TYPE_DICT: Any = vars(type)["__dict__"]
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class statement's class, whose attributes can change


def _module_dict(module: object) -> dict[str, Any]:
    # the module type's own descriptor: a module subclass's __getattribute__ never runs
    value = _MODULE_DICT.__get__(module, type(module))
    return value if type(value) is dict else {}


def _skipped(module_name: str) -> bool:
    return module_name in _SKIPPED_MODULES or module_name.partition(".")[0] in _SKIPPED_PACKAGES


def _bookkeeping() -> list[tuple[object, str]]:
    found: list[tuple[object, str]] = []
    for module_name, names in _BOOKKEEPING.items():
        module = sys.modules.get(module_name)
        if not issubclass(type(module), types.ModuleType):
            continue
        namespace = _module_dict(module)
        found.extend((namespace[name], f"{module_name}.{name}") for name in names if name in namespace)
    weakref_module = sys.modules.get("weakref")
    finalize = _module_dict(weakref_module).get("finalize") if weakref_module is not None else None
    if type(finalize) is type:
        registry = _TYPE_DICT.__get__(finalize, type).get("_registry")
        if registry is not None:
            found.append((registry, "weakref.finalize._registry"))
    return found


def _running_threads() -> list[object]:
    """The threads ``threading`` knows are starting or running whose code is the standard library's, read
    from its dictionaries without calling into a thread object."""
    threading_module = sys.modules.get("threading")
    if not issubclass(type(threading_module), types.ModuleType):
        return []
    namespace = _module_dict(threading_module)
    threads: list[object] = []
    for name in ("_active", "_limbo"):
        records = namespace.get(name)
        if type(records) is dict:
            threads.extend(t for t in list(records.values()) if _runs_stdlib_code(t))
    return threads


def _runs_stdlib_code(thread: object) -> bool:
    """Whether ``thread``'s target (or, without one, its class) is defined in the standard library."""
    target = _instance_value(thread, "_target")
    if type(target) is types.MethodType:
        target = target.__func__
    if type(target) is types.FunctionType:
        module = target.__module__
    elif target is None:
        module = _TYPE_DICT.__get__(type(thread), type).get("__module__")
    else:
        return False  # (a callable object, a builtin: whose code it is cannot be told without asking it)
    return type(module) is str and module.partition(".")[0] in sys.stdlib_module_names


def _instance_value(obj: object, name: str) -> object:
    """``obj``'s own attribute ``name`` through the interpreter's descriptors (never a property, never
    ``__getattribute__``); None without one."""
    for klass in type(obj).__mro__:
        namespace = _TYPE_DICT.__get__(klass, type)
        if "__dict__" in namespace and type(namespace["__dict__"]) is types.GetSetDescriptorType:
            try:
                own = namespace["__dict__"].__get__(obj, type(obj))
            except (AttributeError, TypeError):
                own = None
            if type(own) is dict and name in own:
                return own[name]
        slot = namespace.get(name)
        if type(slot) is types.MemberDescriptorType:
            try:
                return slot.__get__(obj, type(obj))
            except AttributeError:
                return None
    return None


def _handle_of(container: object, parent: object, pid: int) -> str | None:
    """The type of the handle ``container`` is for ``pid``, or None: its ``pid``/``_pid`` is ``pid`` and
    its ``returncode``, if kept, says it was not waited for (a waited one's pid may be reused)."""
    if type(container) is dict:
        fields: dict[object, object] = container
        if not any(type(fields.get(name)) is int and fields.get(name) == pid for name in _PID_NAMES):
            return None
        if fields.get("returncode") is not None:
            return None
        kind = type(parent) if parent is not None else dict
    else:
        if not any(type(value := _instance_value(container, name)) is int and value == pid
                   for name in _PID_NAMES):
            return None
        if _instance_value(container, "returncode") is not None:
            return None
        kind = type(container)
    return f"{kind.__module__}.{kind.__qualname__}"


_SKIP, _ATOM, _INT, _PLAIN, _CLASS, _FUNCTION = range(1, 7)
"""Never 0: a known type is one lookup."""


class _Walk:
    """The walks of one question: what was seen is not walked again from a later kind of root."""

    def __init__(self, wanted: Collection[int]) -> None:
        self.wanted = set(wanted)
        self.found: dict[int, Holder] = {}
        self.seen: set[int] = set()
        self.kinds: dict[type, int] = {int: _INT}

    def kind_of(self, kind: type) -> int:
        """One lookup per type; never ``isinstance``, which may ask an object for its ``__class__``."""
        known = self.kinds.get(kind)
        if known is None:
            module = _TYPE_DICT.__get__(kind, type).get("__module__")
            if issubclass(kind, _ATOMS):
                known = _ATOM
            elif issubclass(kind, _NOT_WALKED) or (isinstance(module, str) and _skipped(module)):
                known = _SKIP
            elif issubclass(kind, type):
                known = _CLASS
            elif kind is types.FunctionType:
                known = _FUNCTION
            else:
                known = _PLAIN  # (an int subclass too: walked, never taken for a pid)
            self.kinds[kind] = known
        return known

    def walk(self, roots: Iterable[tuple[object, str]], kind: HolderKind) -> None:
        queue: deque[tuple[object, str, object]] = deque()
        seen, wanted, kinds, kind_of = self.seen, self.wanted, self.kinds, self.kind_of
        for obj, name in roots:
            if kinds.get(type(obj)) or kind_of(type(obj)) > _INT:
                queue.append((obj, name, None))
        while queue and wanted:
            obj, name, parent = queue.popleft()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            how = kinds[type(obj)]
            referents: Iterable[object]
            if how == _CLASS:
                klass = cast(type, obj)
                if not klass.__flags__ & _HEAP_TYPE or self.kind_of(klass) == _SKIP:
                    continue  # (a class of pytest's, say: its own module is skipped)
                # A class's own attributes (a singleton kept as a class attribute), not its bases.
                referents = list(_TYPE_DICT.__get__(klass, type).values())
            elif how == _FUNCTION:
                # A closure, defaults and attributes; never the globals (a module's are roots).
                function = cast(types.FunctionType, obj)
                globals_, builtins_ = function.__globals__, getattr(function, "__builtins__", None)
                referents = [r for r in gc.get_referents(obj) if r is not globals_ and r is not builtins_]
            else:
                referents = gc.get_referents(obj)
            for ref in referents:
                how = kinds.get(type(ref)) or kind_of(type(ref))
                if how == _INT:
                    if ref in wanted:
                        handle = _handle_of(obj, parent, cast(int, ref))
                        if handle is not None:
                            wanted.discard(cast(int, ref))
                            self.found[cast(int, ref)] = (kind, name, handle)
                elif how > _INT and id(ref) not in seen:
                    queue.append((ref, name, obj))


def holders(pids: Collection[int], fixtures: Iterable[tuple[str, object]] = (),
            suite_files: Sequence[str] = (), *, modules: bool = True) -> dict[int, Holder]:
    """What holds the handle of each of ``pids`` that a live object holds. ``suite_files``: the suite's own
    modules, whose globals keep nothing for the pytest process. Without ``modules`` only the fixtures'
    values are walked (the modules are the whole heap)."""
    if not pids:
        return {}
    walk = _Walk(pids)
    threads = _running_threads()
    walk.seen.update(id(thread) for thread in threads)  # bookkeeping wherever found
    if not modules:
        walk.walk([(value, token) for token, value in fixtures], "fixture")
        return walk.found
    bookkeeping = _bookkeeping()
    walk.seen.update(id(obj) for obj, _ in bookkeeping)  # (walked last, as their own kind)
    roots: list[tuple[object, str]] = []
    for module_name, module in list(sys.modules.items()):
        if not issubclass(type(module), types.ModuleType) or _skipped(module_name):
            continue
        namespace = _module_dict(module)
        file = namespace.get("__file__")
        if suite_files and type(file) is str and any(fnmatch(os.path.basename(file), p) for p in suite_files):
            continue
        walk.seen.add(id(namespace))
        roots.extend((value, f"{module_name}.{key}") for key, value in list(namespace.items())
                     if not (type(key) is str and key.startswith("__") and key.endswith("__")))
    walk.walk(roots, "module")
    if walk.wanted:
        walk.walk([(value, token) for token, value in fixtures], "fixture")
    if walk.wanted:
        walk.seen.difference_update(id(obj) for obj, _ in bookkeeping)
        walk.seen.difference_update(id(thread) for thread in threads)
        walk.walk(bookkeeping, "bookkeeping")
    return walk.found
