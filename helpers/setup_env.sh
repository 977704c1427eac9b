#!/usr/bin/env bash
# Create (once) the project's virtual environment in .venv from requirements.txt, which installs
# the project into it (editable: `-e .[test]`, so `import torchtitan` works from anywhere and
# edits take effect at once) with its dependencies, then put the venv on PATH.
#
#   source helpers/setup_env.sh                      # python3 must be Python >= 3.11
#   PYTHON=python3.11 source helpers/setup_env.sh    # choose the interpreter for the venv
#   VENV=/elsewhere/venv source helpers/setup_env.sh # another venv folder
#
# Sourced by run_demo.sh, run_tests.sh and by users in their own shell; re-installs only when
# requirements.txt or pyproject.toml changes (or the venv is used by another checkout). It
# leaves the options of the shell that sources it as they were (no `set -e` left behind in an
# interactive shell): the checks and the install run in a subshell, and only PATH is exported.
# When Python is too old or the install fails it prints why and returns non-zero, exporting
# nothing.
#
# Everything below must work under the caller's options, whatever they are (e.g. `set -u`).

_em_setup_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_em_setup_venv="${VENV:-$_em_setup_root/.venv}"

(
  ROOT="$_em_setup_root"
  VENV="$_em_setup_venv"
  PYTHON="${PYTHON:-python3}"
  fail() { echo "setup_env.sh: error: $*" >&2; exit 1; }

  # The stamp: the hash of this checkout's path (the editable install points at it) and of
  # requirements.txt and pyproject.toml; a change to any of them re-installs.
  for f in requirements.txt pyproject.toml; do
    [ -r "$ROOT/$f" ] || fail "cannot read $ROOT/$f"
  done
  stamp="$VENV/.setup.sha256"
  want="$( { echo "$ROOT"; cat "$ROOT/requirements.txt" "$ROOT/pyproject.toml"; } \
           | sha256sum | cut -d' ' -f1)"
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
    exit 0  # up to date
  fi

  # Python >= 3.11 is needed (the config reader uses the standard library's tomllib).
  found="$(command -v "$PYTHON" 2>/dev/null)" \
    || fail "no Python interpreter '$PYTHON' found. Python >= 3.11 is needed; choose one with" \
            "the PYTHON variable, e.g.: PYTHON=/usr/bin/python3.11 source helpers/setup_env.sh"
  shown="'$PYTHON'"
  [ "$found" = "$PYTHON" ] || shown="'$PYTHON' ($found)"
  version="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
    || fail "$shown did not run. Python >= 3.11 is needed; choose another" \
            "interpreter with the PYTHON variable, e.g.: PYTHON=python3.11 source helpers/setup_env.sh"
  major="${version%%.*}"
  minor="${version#*.}"
  case "$major:$minor" in
    *[!0-9:]* | :* | *:) fail "could not read the version of $shown: got '$version'" ;;
  esac
  if [ "$major" -lt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -lt 11 ]; }; then
    fail "Python >= 3.11 is needed (tomllib), but $shown is Python $version." \
         "Choose another interpreter with the PYTHON variable, e.g.:" \
         "PYTHON=python3.11 source helpers/setup_env.sh (or PYTHON=python3.11 ./run_tests.sh)"
  fi

  echo "setting up $VENV from requirements.txt and pyproject.toml with Python $version ($found) (once) ..."
  # A venv whose pip no longer runs (an interrupted earlier set-up) is made again from scratch.
  clear=""
  if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    echo "$VENV: its pip does not run (an interrupted set-up?); creating it again"
    clear="--clear"
  fi
  "$PYTHON" -m venv $clear "$VENV" || fail "'$PYTHON -m venv $VENV' failed"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
  # requirements.txt installs the project itself, editable (`-e .[test]`, a path relative to
  # the folder pip runs in: hence the cd), with its pinned dependencies and the test tools.
  # (setuptools warns that folders named like the packages in the working directory come
  # first: they are these very folders.)
  (cd "$ROOT" && PYTHONWARNINGS="ignore:Editable installation" \
     "$VENV/bin/python" -m pip install --quiet -r requirements.txt) \
    || fail "installing requirements.txt (the project, editable, and its dependencies) into" \
            "$VENV failed (see pip's message above)"
  echo "$want" > "$stamp" || fail "cannot write $stamp"
)
_em_setup_rc=$?

if [ "$_em_setup_rc" -eq 0 ]; then
  export PATH="$_em_setup_venv/bin:$PATH"
fi
unset _em_setup_root _em_setup_venv
# `return` when sourced, `exit` when run as a script; the status is expanded into the string
# before eval runs, so that the helper variable can be unset too.
eval "unset _em_setup_rc; return $_em_setup_rc 2>/dev/null || exit $_em_setup_rc"
