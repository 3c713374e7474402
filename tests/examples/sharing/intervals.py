"""What an inner test of the sharing tests records: when it ran on which GPUs ($SHARING_EVENTS)."""

import json
import os
import time

EVENTS = os.environ["SHARING_EVENTS"]


def use_gpus(request, seconds):
    """Occupy the GPUs this test was given, recording when and which."""
    visible = os.environ["CUDA_VISIBLE_DEVICES"]
    start = time.monotonic_ns()
    time.sleep(seconds)
    end = time.monotonic_ns()
    line = json.dumps({"session": os.environ.get("SESSION_TAG"), "pid": os.getpid(),
                       "test": request.node.nodeid, "start": start, "end": end, "visible": visible,
                       "visible_at_end": os.environ["CUDA_VISIBLE_DEVICES"]})
    fd = os.open(EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())  # one write of < PIPE_BUF bytes: lines never interleave
    finally:
        os.close(fd)
