# Sourced (bash): `uv_install PYTHON ARGS...` installs packages into the environment of PYTHON (a
# venv's bin/python) with uv, pinned here and installed into that venv by pip when it lacks that version.
#
# Why uv and not pip: uv keeps unpacked wheels in its cache (${UV_CACHE_DIR:-~/.cache/uv}, keyed by
# package version) and hardlinks them into the venv, so a fresh venv with warm caches costs seconds.
# Measured on this 2-core machine, the project with [dev,quantjob] (5.3 GB) into a fresh venv:
# pip with a warm pip cache and --no-compile 60 s; uv with a warm uv cache 3.9 s, cold 15 s; the same
# versions resolved (`pip list` of both venvs differs only in pip itself). Like pip --no-compile, uv
# does not byte-compile: Python compiles what is imported, once, on first import.
# pip's settings are carried over where uv names them differently: PIP_FIND_LINKS and PIP_CERT.
# UV_NICE, when set, prefixes the install (e2e/build.sh gives its background builds `nice -n 10`).
FEWERBITS_UV_VERSION=0.13.8

uv_install() {
  local py="$1"; shift
  "$py" -m uv --version 2>/dev/null | grep -q "^uv $FEWERBITS_UV_VERSION\b" ||
    "$py" -m pip install -q --disable-pip-version-check "uv==$FEWERBITS_UV_VERSION"
  local env=()
  [[ -z "${UV_FIND_LINKS:-}" && -n "${PIP_FIND_LINKS:-}" ]] && env+=("UV_FIND_LINKS=$PIP_FIND_LINKS")
  [[ -z "${SSL_CERT_FILE:-}" && -n "${PIP_CERT:-}" ]] && env+=("SSL_CERT_FILE=$PIP_CERT")
  env "${env[@]}" ${UV_NICE:-} "$py" -m uv pip install -q --python "$py" "$@"
}
