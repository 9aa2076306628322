"""Build the Redis module (``srio_redisai.so``) from the C sources next to this file.

Used by the Makefile (``make setup``) and by the wheel's build step (``setup.py``); not installed.
The module API header, ``redismodule.h``, is not in the repository: it comes from the
``redis-module`` crate on crates.io (a pinned release, checked against its SHA-256) and is cached
in ``$SRIO_REDISMODULE_INCLUDE`` or ``.tools/include`` of the checkout. Every step is skipped when
its result is already there, so running this again costs nothing.

    python smartredis_io/redisai/build.py [--out PATH] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CRATE_VERSION = "2.0.7"
CRATE_URL = f"https://static.crates.io/crates/redis-module/redis-module-{CRATE_VERSION}.crate"
CRATE_SHA256 = "9d3b95d9fe5b8681bacea6532bbc7632590ae4499cecc8e019685b515fddda71"
HEADER_MEMBER = f"redis-module-{CRATE_VERSION}/src/include/redismodule.h"
INCLUDE_ENV = "SRIO_REDISMODULE_INCLUDE"
MODULE_NAME = "srio_redisai.so"
DOWNLOAD_TIMEOUT_S = 60
CFLAGS = ["-O2", "-g", "-std=gnu11", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter",
          "-Werror=implicit-function-declaration"]
LDFLAGS = ["-shared"]


def include_dir() -> Path:
    """Where ``redismodule.h`` is cached: ``$SRIO_REDISMODULE_INCLUDE`` or ``.tools/include``."""
    return Path(os.environ.get(INCLUDE_ENV) or ROOT / ".tools" / "include")


def sources() -> list[Path]:
    """The module's C sources, in a stable order."""
    return sorted(HERE.glob("*.c"))


def fetch_header(dest: Path | None = None) -> Path:
    """``redismodule.h`` of the pinned crate in ``dest`` (downloaded and checked once); its path."""
    dest = dest or include_dir()
    header = dest / "redismodule.h"
    stamp = dest / f"redismodule.h.{CRATE_SHA256[:16]}"
    if header.is_file() and stamp.is_file():
        return header
    print(f">> fetching redismodule.h from {CRATE_URL}", file=sys.stderr)
    with urllib.request.urlopen(CRATE_URL, timeout=DOWNLOAD_TIMEOUT_S) as response:
        crate = response.read()
    digest = hashlib.sha256(crate).hexdigest()
    if digest != CRATE_SHA256:
        raise SystemExit(f"{CRATE_URL}: SHA-256 {digest}, expected {CRATE_SHA256}; not using it")
    with tarfile.open(fileobj=io.BytesIO(crate), mode="r:gz") as tar:
        member = tar.extractfile(HEADER_MEMBER)
        if member is None:
            raise SystemExit(f"{CRATE_URL} has no {HEADER_MEMBER}")
        data = member.read()
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=".redismodule.h.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, header)
    stamp.write_text(f"{CRATE_URL}\n{CRATE_SHA256}\n")
    return header


def build(out: Path | None = None, *, force: bool = False) -> Path:
    """Compile the module into ``out`` (default: next to the sources) unless it is newer than its inputs."""
    out = Path(out) if out else HERE / MODULE_NAME
    header = fetch_header()
    inputs = [*sources(), *HERE.glob("*.h"), header]
    if not force and out.is_file() and out.stat().st_mtime >= max(p.stat().st_mtime for p in inputs):
        return out
    cc = shlex.split(os.environ.get("CC", "cc"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    # Debug information names sources relative to these directories, so a module built in a checkout
    # or a build directory carries no path of that machine into a wheel.
    prefix_maps = [f"-ffile-prefix-map={where}={name}"
                   for where, name in ((ROOT, "."), (header.parent, "include"), (Path.cwd(), "."))]
    command = [*cc, *CFLAGS, *prefix_maps, *shlex.split(os.environ.get("CFLAGS", "")), "-I", str(header.parent),
               *map(str, sources()), *LDFLAGS, "-o", str(tmp)]
    print(">> " + " ".join(command), file=sys.stderr)
    try:
        subprocess.run(command, check=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help=f"where to write the module (default: {HERE / MODULE_NAME})")
    parser.add_argument("--force", action="store_true", help="compile even when the module is up to date")
    parser.add_argument("--header-only", action="store_true", help="only fetch redismodule.h")
    args = parser.parse_args(argv)
    if args.header_only:
        print(fetch_header())
        return 0
    print(build(args.out, force=args.force))
    return 0


if __name__ == "__main__":
    sys.exit(main())
