# Sourced by the Dockerfiles' RUN steps (POSIX sh): `venv DIR` makes the image's virtual environment
# and `pip` runs a pip that works on either kind of base image.
#
# * A wheelhouse mounted at /wheels (scripts/images.sh mounts one, made from the pins): pip is the
#   pinned pip wheel found there, run from the wheel itself, and installs from /wheels only
#   (--no-index). The base needs Python 3.11 and nothing else.
# * No wheelhouse (`docker build` FROM the public python image): the base's own pip and the index.
#
# Either way the venv has no pip of its own: nothing that installs packages reaches the final stage.
set -eu
VENV=/opt/fewerbits

venv() {
  python3.11 -m venv --without-pip "$VENV"
  # The project itself is installed apart (/opt/fewerbits-app, a small last layer), so a source
  # change does not rebuild the large dependency layer.
  echo /opt/fewerbits-app > "$VENV/lib/python3.11/site-packages/fewerbits-app.pth"
}

pip() {
  _sub=$1; shift
  _wheel=$(ls /wheels/pip-*.whl 2>/dev/null | head -n 1 || true)
  if [ -n "$_wheel" ]; then
    "$VENV/bin/python" "$_wheel/pip" "$_sub" --no-index --find-links /wheels \
      --no-cache-dir --disable-pip-version-check --no-input --progress-bar off "$@"
  elif python3.11 -m pip --version >/dev/null 2>&1; then
    python3.11 -m pip --python "$VENV/bin/python" "$_sub" \
      --no-cache-dir --disable-pip-version-check --no-input --progress-bar off --root-user-action=ignore "$@"
  else
    echo "pip.sh: no pip: mount a wheelhouse with a pip wheel at /wheels (scripts/images.sh does) or build FROM an image with pip" >&2
    return 1
  fi
}
