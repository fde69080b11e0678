#!/usr/bin/env python3
"""Weights from a mapped file to the GPU, every way cuda-runner has had, side by side (GPU machine).

A file laid out as the 1B decoder's bundle holds its storages (the same 181
sizes, 2.2 GB, random bytes) is mapped as the bundle reader maps it, afresh
for every round as every load maps its bundle afresh, and uploaded to device
memory by:

  upload_all       runtime/upload.py: blocks of the mapping registered and
                   copied by several threads (1, 2, 4, 8, 16), each let go once
                   its copies arrive; "let go later" as loads use it, the
                   registrations let go on a thread after it returns
  upload_all, staged   the same threads, each block copied from the mapping
                   through pinned slots (the path where registration is refused)
  per storage, registered   the previous loader: register each storage,
                   copy it, let it go, one after another
  per storage, pageable     cudaMemcpy from the mapping as it is

beside the link's own ceiling: the same bytes from one pinned allocation
(cudaHostAlloc) in 64 MB copies. The file is in the page cache (bench_scale.py's load stage measures a load
from the disk: posix_fadvise cannot drop the pages of a file this process has
mapped). Every result is read back and compared once. Also the device allocations of
the same storages: one cudaMalloc each against one for all; and, on one
thread, how the registered upload's time splits between registering, copying
and unregistering (blocks as loads cut them, and the whole file as one block).

    python3 scripts/bench_upload.py --output upload.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuda_runner.runtime import upload
from cuda_runner.runtime.cuda import HOST_REGISTER_READ_ONLY, HOST_TO_DEVICE, cuda_runtime
from cuda_runner.runtime.host import buffer_address


def llama_1b_storages() -> list[int]:
    """Byte sizes of the 1B decoder's storages (scripts/scale_models.py, LLAMA_1B, bf16), in bundle order."""
    dim, ffn, vocab, kv, layers, cache = 2048, 8192, 32000, 512, 16, 8 * 512 * 64
    sizes = [vocab * dim * 2]
    for _ in range(layers):
        sizes += [dim * 2, dim * dim * 2, kv * dim * 2, kv * dim * 2, dim * dim * 2, cache * 2, cache * 2, dim * 2,
                  ffn * dim * 2, ffn * dim * 2, dim * ffn * 2]
    return [*sizes, dim * 2, vocab * dim * 2]


def per_storage(runtime, uploads, register: bool) -> None:
    for item in uploads:
        address, size = buffer_address(item.source), item.source.nbytes
        if register:
            runtime.hostRegister(address, size, HOST_REGISTER_READ_ONLY)
        try:
            runtime.memcpy(item.destination, address, size, HOST_TO_DEVICE)
        finally:
            if register:
                runtime.hostUnregister(address)


def registration_parts(runtime, uploads, block_bytes: int) -> dict[str, float]:
    """One thread, blocks of `block_bytes`: seconds spent registering, copying
    (queued and waited for) and unregistering, each summed over the blocks,
    to tell which part of the registered upload the time goes to."""
    stream = runtime.streamCreateWithFlags(1)
    parts = {"register_s": 0.0, "copy_s": 0.0, "unregister_s": 0.0}
    clock = time.perf_counter
    try:
        for block in upload.blocks_of(uploads, block_bytes):
            started = clock()
            runtime.hostRegister(block.start, block.end - block.start, HOST_REGISTER_READ_ONLY)
            registered = clock()
            for source, destination, nbytes in block.copies:
                runtime.memcpyAsync(destination, source, nbytes, HOST_TO_DEVICE, stream)
            runtime.streamSynchronize(stream)
            copied = clock()
            runtime.hostUnregister(block.start)
            parts["register_s"] += registered - started
            parts["copy_s"] += copied - registered
            parts["unregister_s"] += clock() - copied
    finally:
        runtime.streamDestroy(stream)
    return {key: round(value, 4) for key, value in parts.items()}


def allocations(runtime, sizes: list[int], rounds: int) -> dict[str, float]:
    """Seconds to allocate the storages' device memory: a cudaMalloc each (the loader before), or one for all (now)."""
    each, one = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        pointers = [runtime.malloc(size) for size in sizes]
        each.append(time.perf_counter() - started)
        for pointer in pointers:
            runtime.free(pointer)
        started = time.perf_counter()
        pointer = runtime.malloc(sum(-(-size // 256) * 256 for size in sizes))
        one.append(time.perf_counter() - started)
        runtime.free(pointer)
    result = {"a cudaMalloc per storage, s": round(statistics.median(each), 4), "one cudaMalloc, s": round(statistics.median(one), 4)}
    print(f"device allocations: {result}", flush=True)
    return result


def pinned_ceiling(runtime, device, total: int, rounds: int) -> dict[str, float]:
    """GB/s of the same byte count from one pinned allocation, in 64 MB copies on one stream: what the link gives."""
    block = 64 << 20
    host = runtime.hostAlloc(block, 0)
    try:
        seconds = []
        for _ in range(rounds):
            runtime.deviceSynchronize()
            started = time.perf_counter()
            for offset in range(0, total, block):
                runtime.memcpyAsync(device.data.ptr + offset, host, min(block, total - offset), HOST_TO_DEVICE, 0)
            runtime.deviceSynchronize()
            seconds.append(time.perf_counter() - started)
    finally:
        runtime.freeHost(host)
    result = {"warm_s": [round(value, 4) for value in seconds], "gb_per_s": round(total / statistics.median(seconds) / 1e9, 2)}
    print(f"{'pinned memory, the ceiling':<36} {result['gb_per_s']:6.2f} GB/s", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()))
    options = parser.parse_args()
    import cupy

    runtime = cuda_runtime()
    sizes = llama_1b_storages()
    total = sum(sizes)
    path = options.folder / "cuda-runner-upload-bench.bin"
    rng = np.random.default_rng(0)
    with path.open("wb") as handle:  # segments 64-byte aligned, as in a bundle
        for size in sizes:
            handle.write(rng.integers(0, 256, size, dtype=np.uint8).tobytes() + bytes(-size % 64))
    device = cupy.empty(total + 256 * len(sizes), dtype=cupy.uint8)

    handle = path.open("rb")

    def mapped() -> tuple[mmap.mmap, list[upload.Upload]]:
        """A fresh mapping of the file (as a load has) and the uploads that read it."""
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        uploads, offset, target = [], 0, 0
        for size in sizes:
            uploads.append(upload.Upload(memoryview(mapping)[offset:offset + size], device.data.ptr + target))
            offset += size + (-size % 64)
            target += size + (-size % 256)
        return mapping, uploads

    strategies = {f"upload_all, {n} threads": (lambda uploads, n=n: upload.upload_all(runtime, 0, uploads, threads=n)) for n in (1, 2, 4, 8, 16)}
    # Until it returns; the registrations are let go on a thread after (waited for outside the timing).
    strategies["upload_all, 4 threads, let go later"] = lambda uploads: upload.upload_all(runtime, 0, uploads, threads=4, release_later=True)
    strategies["upload_all, 4 threads, staged"] = lambda uploads: upload.upload_all(runtime, 0, uploads, threads=4, register=False)
    strategies["per storage, registered (before)"] = lambda uploads: per_storage(runtime, uploads, register=True)
    strategies["per storage, pageable"] = lambda uploads: per_storage(runtime, uploads, register=False)
    results: dict[str, object] = {"bytes": total, "storages": len(sizes), "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                                  "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    results["pinned ceiling"] = pinned_ceiling(runtime, device, total, options.rounds)
    checked = False
    for label, strategy in strategies.items():
        seconds = []
        for _ in range(options.rounds):
            mapping, uploads = mapped()
            device.fill(0)
            runtime.deviceSynchronize()
            started = time.perf_counter()
            strategy(uploads)
            runtime.deviceSynchronize()
            seconds.append(time.perf_counter() - started)
            upload.wait_for_releases()  # before the mapping closes
            if not checked:
                host = cupy.asnumpy(device)
                for item in uploads:
                    start = item.destination - device.data.ptr
                    assert bytes(host[start:start + item.source.nbytes]) == bytes(item.source), label
                checked = True
            for item in uploads:
                item.source.release()
            mapping.close()
        median = statistics.median(seconds)
        results[label] = {"warm_s": [round(value, 4) for value in seconds], "warm_gb_per_s": round(total / median / 1e9, 2)}
        print(f"{label:<36} warm {total / median / 1e9:6.2f} GB/s  ({', '.join(f'{value:.3f}' for value in seconds)} s)", flush=True)
    for label, block_bytes in (("64 MiB blocks", upload.BLOCK_BYTES), ("one block", total * 2)):
        mapping, uploads = mapped()
        parts = registration_parts(runtime, uploads, block_bytes)
        results[f"registered upload's parts, 1 thread, {label}"] = parts
        print(f"registered upload's parts, 1 thread, {label}: " + ", ".join(f"{key} {value:.3f}" for key, value in parts.items()), flush=True)
        for item in uploads:
            item.source.release()
        mapping.close()
    results["device allocations"] = allocations(runtime, sizes, options.rounds)
    handle.close()
    path.unlink()
    if options.output is not None:
        options.output.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
