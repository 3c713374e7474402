#!/usr/bin/env bash
# Stage third-party GPU test suites, unmodified, for benchmarks/peers/run_suites.sh (docs/compat.md, "Real
# suites, unchanged"). Run from anywhere, on a machine with network (the H200 machine has none): it fills the
# git-ignored folder .suites/ of the checkout, which then travels to the GPU machine (`carry: [".suites"]`).
#
#   bash benchmarks/peers/stage_suites.sh [SUITE ...]     (default: every suite below)
#
# Each suite's tests come from the library's own release, at the version installed on the H200 image
# (docs/compat.md lists them): the PyPI sdist where it ships its tests (accelerate, gpytorch), else the
# library's GitHub repository at its release tag, through a local git mirror ($SUITES_MIRROR/<owner>+<name>/repo,
# default /work/.mirror: what the session's fetch tool brings) or a shallow `git clone` from github.com.
# .suites/<suite>/SOURCE says where each came from: the version, the tag and its commit (or the sdist's
# SHA-256). .suites/wheels/ holds the pure-Python test helpers the suites import that the H200 image lacks
# (for Python 3.12); run_suites.sh installs them into a folder of its own there, never over the image's.
# The whole of .suites/ must stay well under 40 MiB (the checkout and it travel in one 64 MiB call); the
# script prints its size.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
dest=$root/.suites
python=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mirror=${SUITES_MIRROR:-/work/.mirror}
all=(lightning pyg torchmetrics accelerate gpytorch joblib)
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=("${all[@]}")
mkdir -p "$dest"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

source_line() {  # SUITE KEY=VALUE...: .suites/SUITE/SOURCE, one key=value a line, with the date
    local suite=$1; shift
    { printf '%s\n' "$@"; echo "staged=$(date -u +%Y-%m-%dT%H:%M:%SZ)"; } > "$dest/$suite/SOURCE"
}

from_github() {  # SUITE OWNER/NAME TAG VERSION PATH...: PATHs of the repository at TAG into .suites/SUITE
    local suite=$1 repo=$2 tag=$3 version=$4; shift 4
    local git_dir="$mirror/${repo/\//+}/repo" via
    if [ -d "$git_dir" ] && git --git-dir="$git_dir" rev-parse -q --verify "refs/tags/$tag^{commit}" >/dev/null
    then
        via="git mirror $git_dir"
    else
        git_dir="$scratch/$suite.git"
        git clone -q --bare --depth 1 --branch "$tag" --filter=blob:none "https://github.com/$repo" "$git_dir" \
            || { echo "stage_suites.sh: $suite: tag $tag of $repo is neither in $mirror nor reachable on github.com" >&2
                 return 1; }
        via="git clone https://github.com/$repo"
    fi
    local commit
    commit=$(git --git-dir="$git_dir" rev-parse "refs/tags/$tag^{commit}")
    rm -rf "${dest:?}/$suite" && mkdir -p "$dest/$suite"
    # (A mirror may lack blobs elsewhere in the tree, e.g. large images: git archive names them and goes on;
    # the count below proves the staged paths whole.)
    git --git-dir="$git_dir" archive --format=tar "$commit" -- "$@" | tar -x -C "$dest/$suite"
    local want got
    want=$(git --git-dir="$git_dir" ls-tree -r --name-only "$commit" -- "$@" | wc -l)
    got=$(find "$dest/$suite" -type f | wc -l)
    [ "$want" = "$got" ] || { echo "stage_suites.sh: $suite: $got of $want files staged" >&2; return 1; }
    source_line "$suite" "suite=$suite" "version=$version" "repository=https://github.com/$repo" "tag=$tag" \
        "commit=$commit" "paths=$*" "via=$via"
}

from_sdist() {  # SUITE DIST VERSION TOP PATH...: PATHs of DIST's sdist into .suites/SUITE
    local suite=$1 dist=$2 version=$3 top=$4; shift 4
    "$python" -m pip download -q --no-deps --no-binary :all: -d "$scratch/$suite" "$dist==$version"
    local archive
    archive=$(ls "$scratch/$suite"/*.tar.gz)
    rm -rf "${dest:?}/$suite" && mkdir -p "$dest/$suite"
    tar -xzf "$archive" -C "$dest/$suite" --strip-components=1 "${@/#/$top/}"
    source_line "$suite" "suite=$suite" "version=$version" "sdist=https://pypi.org/project/$dist/$version/" \
        "file=$(basename "$archive")" "sha256=$(sha256sum "$archive" | cut -d' ' -f1)" "paths=$*"
}

for suite in "${suites[@]}"; do
    case $suite in
    lightning)
        # pytorch-lightning and lightning 2.6.6 are on the H200 image; the mirror's newest release tag is 2.6.5
        # (2.6.6, 2026-09-10, came later). 2.6.6's source is 2.6.5's plus one fix in
        # lightning/pytorch/core/saving.py (checkpoint `_instantiator`/`_class_path` allowlist, #21832, #21914):
        # no test of tests_fabric touches it. LIGHTNING_TAG=2.6.6 takes that tag once a mirror has it.
        from_github lightning Lightning-AI/pytorch-lightning "${LIGHTNING_TAG:-2.6.5}" 2.6.6 \
            tests/tests_fabric tests/tests_pytorch pyproject.toml ;;
    pyg)
        from_github pyg pyg-team/pytorch_geometric 2.8.0.post1 2.8.0.post1 test pyproject.toml ;;
    torchmetrics)
        from_github torchmetrics Lightning-AI/torchmetrics v1.9.0 1.9.0 tests/unittests pyproject.toml ;;
    accelerate)
        # accelerate's sdist ships tests/*.py (not tests/test_configs, tests/test_samples, tests/deepspeed, ...;
        # the tests that need those are deselected by run_suites.sh); the mirror has no v1.15.0 tag.
        from_sdist accelerate accelerate 1.15.0 accelerate-1.15.0 tests pyproject.toml setup.cfg ;;
    gpytorch)
        # gpytorch's sdist holds test/ whole (the same 151 files as the v1.15.2 tag).
        from_sdist gpytorch gpytorch 1.15.2 gpytorch-1.15.2 test pyproject.toml setup.cfg ;;
    joblib)
        # joblib's sdist ships the package with its tests (joblib/test); the suite runs on that copy of the
        # package, the release's own source (its root conftest.py puts the folder first on sys.path).
        from_sdist joblib joblib 1.6.0 joblib-1.6.0 joblib conftest.py pyproject.toml ;;
    *)
        echo "stage_suites.sh: no suite $suite (suites: ${all[*]})" >&2
        exit 2 ;;
    esac
    echo "staged $suite: $(tr '\n' ' ' < "$dest/$suite/SOURCE")"
done

# Test helpers the suites import and the H200 image lacks (pure Python, for its Python 3.12): Lightning's
# and torchmetrics' `flaky` marker (pytest-rerunfailures, with --strict-markers), torchmetrics'
# --doctest-plus (pytest-doctestplus) and reference cache (cachier, which needs watchdog), accelerate's
# `parameterized`. Not tensorboardX, although one Lightning test imports it by name: where it is there,
# Lightning's loggers use it rather than the image's tensorboard, and its conftest then waits 20 s for
# tensorboardX's queue thread after each of 7 tests.
if [ "${SUITES_WHEELS:-1}" = 0 ]; then  # (CI installs the libraries itself: .ci/peers setup-suites)
    du -sh "$dest"
    exit 0
fi
rm -rf "$dest/wheels" && mkdir -p "$dest/wheels"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform any -d "$dest/wheels" \
    pytest-rerunfailures==16.1 pytest-doctestplus==1.4.0 cachier==4.1.0 watchdog==6.0.0 parameterized==0.9.0
ls "$dest/wheels"
echo "test files: $(for s in "${all[@]}"; do [ -d "$dest/$s" ] && printf '%s %s  ' "$s" \
    "$(find "$dest/$s" -name 'test_*.py' | wc -l)"; done)"
du -sh "$dest" "$dest"/*
