"""What checking a signature adds to loading a bundle, side by side in one run.

A bundle with GiB-scale weights is compiled once, then loaded (page cache warm)
in alternating rounds: without a signature check, with a sharded signature
(SHA-256 per 16 MiB shard, on all cores, overlapped with the weights upload),
and with a whole-file signature (one SHA-256, the form `model_signing verify
key` checks).

    python scripts/bench_signing.py --device cuda --weights-gib 1 [--rounds 5] [--output signing.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import bench_compare  # scripts/ is this script's own folder

import cuda_runner
from cuda_runner.format.signing import DEFAULT_SHARD_SIZE, sign_file, signature_path


def _key_pair(folder: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = folder / "key.pem", folder / "key.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def load_seconds(bundle: Path, keys: list[Path]) -> float:
    started = time.perf_counter()
    with cuda_runner.load(bundle, trusted_keys=keys):
        pass
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--weights-gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    import torch

    os.environ.pop("CUDA_RUNNER_TRUSTED_KEYS", None)
    work = Path(tempfile.mkdtemp(prefix="cuda-runner-signing-"))
    width = int((options.weights_gib * (1 << 30) / 4) ** 0.5) // 256 * 256
    module = torch.nn.Linear(width, width, bias=False).eval()
    bundle = bench_compare.compile_bundle(torch, "weights", module, (torch.randn(2, width),), options.device, work)
    private, public = _key_pair(work)
    signatures = {}
    for label, shard_size in (("sharded", DEFAULT_SHARD_SIZE), ("whole_file", None)):
        started = time.perf_counter()
        sign_file(bundle, private, shard_size=shard_size)
        signatures[label] = (signature_path(bundle).read_bytes(), time.perf_counter() - started)
    samples: dict[str, list[float]] = {"unsigned": [], "sharded": [], "whole_file": []}
    load_seconds(bundle, [])  # warm the page cache, libtorch and the CUDA context
    for _ in range(options.rounds):
        samples["unsigned"].append(load_seconds(bundle, []))
        for label in ("sharded", "whole_file"):
            signature_path(bundle).write_bytes(signatures[label][0])
            samples[label].append(load_seconds(bundle, [public]))
    report: dict = {"machine": platform.node(), "cpus": os.cpu_count(), "device": options.device, "bundle_bytes": bundle.stat().st_size,
                    "rounds": options.rounds, "sign_seconds": {label: value[1] for label, value in signatures.items()}}
    for label, values in samples.items():
        report[f"load_{label}_s"] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    base = report["load_unsigned_s"]["median"]
    for label in ("sharded", "whole_file"):
        report[f"added_{label}_percent"] = 100 * (report[f"load_{label}_s"]["median"] - base) / base
    bench_compare.write_report(report, options.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
