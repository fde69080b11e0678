from __future__ import annotations

import os
import random

from forge import digest as spec_digest

from cuda_runner.format.digest import DIGEST_CHUNK, TreeHasher, segment_digest


def test_digest_follows_the_specified_chunked_construction():
    for size in (0, 1, DIGEST_CHUNK - 1, DIGEST_CHUNK, DIGEST_CHUNK + 1, 2 * DIGEST_CHUNK + 5):
        data = os.urandom(size)
        assert segment_digest(data) == spec_digest(data)
        assert segment_digest(data, workers=1) == segment_digest(data, workers=8)


def test_streamed_digest_equals_the_whole_one_for_any_split():
    data = os.urandom(2 * DIGEST_CHUNK + 12345)
    rng = random.Random(0)
    for _ in range(5):
        hasher = TreeHasher()
        position = 0
        while position < len(data):
            step = rng.choice([1, 4096, DIGEST_CHUNK - 3, 8 << 20])
            hasher.update(data[position:position + step])
            position += step
        assert hasher.hexdigest() == segment_digest(data)


def test_any_changed_byte_changes_the_digest():
    data = bytearray(os.urandom(DIGEST_CHUNK + 100))
    reference = segment_digest(bytes(data))
    for offset in (0, DIGEST_CHUNK - 1, DIGEST_CHUNK, len(data) - 1):
        data[offset] ^= 0x40
        assert segment_digest(bytes(data)) != reference
        data[offset] ^= 0x40
