"""Prove the GPU paths in one call on a machine lent with a GPU (``make gpu-check``).

That machine has no network, Python 3.12 and its own torch (2.11 + CUDA), but none of lmdb, blake3 or
zstandard: ``make gpu-wheels`` downloads them here, for its Python, into ``build/gpu-wheels`` (carry
that folder). This script then, within ``--budget`` seconds in all:

1. installs those wheels into a private folder (``--no-index``: nothing is fetched) and runs with
   the checkout on ``PYTHONPATH`` (``import paramstore`` works from a plain checkout);
2. runs every ``gpu``-marked test (``pytest -m gpu``), its report in ``OUT/gpu-tests.xml``;
3. runs the GPU rows of ``tools/bench_device.py`` (``OUT/bench_device.md`` and ``.json``);
4. commits a model of CUDA tensors, checks it out with ``device="cuda"`` into a CUDA model and
   compares every tensor bit for bit (``OUT/gpu-check.json``).

``OUT`` is ``$OUT`` (the device tool's folder that comes back) or ``build/gpu-check``. Without a
CUDA device it says so and exits 0. Exit 1 when a step failed.

    make gpu-wheels                              # here, with the network
    # device tool: run("make gpu-check", carry=["build/gpu-wheels"])
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEELS = os.path.join(REPO, "build", "gpu-wheels")
#: Test files holding gpu-marked tests (collected alone: the others need the CPU machine's extras).
GPU_TESTS = ["tests/test_device.py", "tests/test_pinning.py", "tests/test_collective.py",
             "tests/test_silent_failures.py", "tests/test_tier_contract.py"]


def cuda_devices() -> int:
    """How many CUDA devices this process sees (0 without torch's CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def install(site: str) -> str:
    """Install the carried wheels into ``site`` (none fetched); returns what pip said."""
    wheels = sorted(glob.glob(os.path.join(WHEELS, "*.whl")))
    if not wheels:
        return "no wheels carried (build/gpu-wheels is empty): using what this Python has"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                          "--target", site, *wheels], capture_output=True, text=True)
    return (out.stdout + out.stderr).strip() or f"installed {len(wheels)} wheels"


def step(name: str, argv: list[str], env: dict[str, str], timeout: float) -> dict:
    """Run one step as a child process; its result (exit code, seconds, the output's tail)."""
    t0 = time.monotonic()
    try:
        out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(1.0, timeout))
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}{e.stderr or ''}"
    print(f"== {name}: exit {rc} in {time.monotonic() - t0:.1f} s", flush=True)
    return {"name": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": text[-4000:]}


def model_roundtrip() -> dict:
    """Commit CUDA tensors, check them out with ``device="cuda"`` into a CUDA model, compare bits."""
    import torch

    import paramstore

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    twin = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).cuda().to(torch.bfloat16)
    root = tempfile.mkdtemp(prefix="gpu-check-", dir="/dev/shm")
    with paramstore.ParamStore(os.path.join(root, "s")) as store:
        t0 = time.perf_counter()
        store.commit(1, model).result(timeout=120)
        committed = time.perf_counter() - t0
        t0 = time.perf_counter()
        with store.checkout(1, device="cuda") as snap:
            snap.load_into(twin)
            torch.cuda.synchronize()
        loaded = time.perf_counter() - t0
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
               for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    return {"bit_identical": same, "commit_s": round(committed, 4), "checkout_load_s": round(loaded, 4),
            "bytes": sum(t.nbytes for t in model.state_dict().values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for everything (default 8 minutes)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "build", "gpu-check"))
    ap.add_argument("--roundtrip", action="store_true", help=argparse.SUPPRESS)  # step 4, in a child
    a = ap.parse_args()
    if a.roundtrip:
        print(json.dumps(model_roundtrip()))
        return 0
    os.makedirs(a.out, exist_ok=True)
    devices = cuda_devices()
    if not devices:
        print("gpu-check: no CUDA device here: nothing to check (run it on the machine the device tool lends)")
        return 0
    deadline = time.monotonic() + a.budget
    site = tempfile.mkdtemp(prefix="gpu-check-site-")
    report: dict = {"devices": devices, "python": sys.version.split()[0], "install": install(site), "steps": []}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([site, REPO]), "MC_FORCE_TCP": "1"}
    left = lambda: deadline - time.monotonic()  # noqa: E731
    report["steps"].append(step("gpu tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                              "-o", "addopts=", "-m", "gpu", f"--junitxml={a.out}/gpu-tests.xml",
                                              *GPU_TESTS], env, left() * 0.5))
    report["steps"].append(step("bench_device", [sys.executable, "tools/bench_device.py", "--rounds", "3",
                                                 "--json", f"{a.out}/bench_device.json",
                                                 "--markdown", f"{a.out}/bench_device.md"], env, left() * 0.8))
    roundtrip = step("model roundtrip", [sys.executable, "tools/gpu_check.py", "--roundtrip"], env, left())
    report["steps"].append(roundtrip)
    try:
        report["roundtrip"] = json.loads(roundtrip["tail"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        report["roundtrip"] = None
    ok = all(s["rc"] == 0 for s in report["steps"]) and bool(report["roundtrip"]) \
        and report["roundtrip"]["bit_identical"]
    report["ok"] = ok
    with open(os.path.join(a.out, "gpu-check.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"gpu-check: {'ok' if ok else 'FAILED'}; report in {a.out}/gpu-check.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
