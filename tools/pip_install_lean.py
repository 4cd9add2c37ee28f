"""Install Python packages into this interpreter one wheel at a time, keeping no wheel cache.

`make setup` installs torch with its CUDA libraries: about 3.5 GB of wheels that unpack to
about 5 GB. A plain `pip install` downloads every wheel before it installs any and keeps them
in its cache afterwards, so a machine needs about 8.5 GB free at once and keeps 3.5 GB it never
reads again; a CI machine with less ran out of space. Here pip resolves the whole set first
without downloading a wheel (`--dry-run --report`: PyPI serves each wheel's metadata alone),
then installs the resolved versions one by one with `--no-deps --no-cache-dir`, so the most
held at once is what is already installed plus one wheel. The versions are exactly those a
plain install would choose.

Usage: python tools/pip_install_lean.py REQUIREMENT...
"""

import json
import os
import subprocess
import sys
import tempfile

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


def resolve(requirements):
    """The `name==version` pins a plain `pip install` of `requirements` would install."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run(
            PIP + ["install", "--quiet", "--dry-run", "--no-cache-dir", "--report", report]
            + requirements,
            check=True,
        )
        with open(report) as f:
            installs = json.load(f)["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in installs]


def main(requirements):
    if not requirements:
        sys.exit("usage: pip_install_lean.py REQUIREMENT...")
    pins = resolve(requirements)
    for n, pin in enumerate(pins, 1):
        print(f"pip_install_lean: {n}/{len(pins)} {pin}", flush=True)
        subprocess.run(
            PIP + ["install", "--quiet", "--no-deps", "--no-cache-dir", pin], check=True
        )
    # The set was resolved together, so this only fails if an install above was partial.
    subprocess.run(PIP + ["check"], check=True, stdout=subprocess.DEVNULL)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except subprocess.CalledProcessError as e:
        sys.exit(f"pip_install_lean: {' '.join(e.cmd)} failed with exit code {e.returncode}")
