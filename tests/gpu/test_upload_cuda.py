"""The pipelined weight upload on a real GPU: every byte of a few hundred MB of
mapped storages arrives (a bundle loaded through it: test_shared_weights_cuda.py)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from cuda_runner.runtime import upload
from cuda_runner.runtime.cuda import cuda_runtime

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("register", [True, False])
def test_mapped_storages_arrive_byte_for_byte(tmp_path, register):
    import cupy

    sizes = [(64 << 20) + 3, 1, (16 << 20) - 1, 130 << 20, 5000]
    rng = np.random.default_rng(3)
    blobs = [rng.integers(0, 256, size, dtype=np.uint8) for size in sizes]
    path = tmp_path / "weights.bin"
    with path.open("wb") as handle:
        for blob in blobs:
            handle.write(blob.tobytes())
    with path.open("rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    targets = [cupy.empty(size, dtype=cupy.uint8) for size in sizes]
    views, offset = [], 0
    for size in sizes:
        views.append(memoryview(mapping)[offset:offset + size])
        offset += size
    heard = []
    upload.upload_all(cuda_runtime(), 0, [upload.Upload(view, target.data.ptr) for view, target in zip(views, targets)],
                      lambda done, total: heard.append(done), register=register)
    for blob, target in zip(blobs, targets):
        assert np.array_equal(cupy.asnumpy(target), blob)
    assert heard[-1] == sum(sizes)
    for view in views:
        view.release()
    mapping.close()

