"""The bundle file: reader and writer in one module (docs/bundle-format.md).

Layout, all integers little-endian:

    header      64 bytes, fixed (HEADER below)
    manifest    UTF-8 JSON, `manifest_size` bytes, right after the header
    padding     zero bytes up to the next multiple of `alignment`
    segments    each starts at a multiple of `alignment`, zero padding between
    end         the last segment ends the file

The header checksum covers header bytes [0, 48) and the manifest; each
segment has its own digest in the manifest; padding must be zero. Together
they catch a change to any byte of the file.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO, Union

import xxhash

from ..errors import BundleError, InputError, WriteError, os_error
from ..files import open_regular, write_file
from .digest import DIGEST_ALGORITHM, OneCheckEach, TreeHasher, segment_digest
from .manifest import MAX_SEGMENTS, Manifest, SegmentEntry, manifest_from_json
from .signing import SignatureMismatch, SignedFile, TrustedKey, read_signature, signature_path

MAGIC = b"\x89CRB\r\n\x1a\n"
FORMAT_MAJOR = 1
FORMAT_MINOR = 6
HEADER = struct.Struct("<8sHHIQQQII16s")
HEADER_SIZE = 64
CHECKSUMMED_HEADER_BYTES = 48
DEFAULT_ALIGNMENT = 4096
MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 1 << 20
MAX_MANIFEST_SIZE = 16 << 20
_COPY_CHUNK = 8 << 20

assert HEADER.size == HEADER_SIZE

SegmentSource = Union[bytes, bytearray, memoryview, "os.PathLike[str]", str]


@dataclass(frozen=True)
class Header:
    major: int
    minor: int
    header_size: int
    manifest_offset: int
    manifest_size: int
    file_size: int
    alignment: int
    reserved: int
    checksum: bytes

    def pack(self) -> bytes:
        return HEADER.pack(
            MAGIC, self.major, self.minor, self.header_size, self.manifest_offset,
            self.manifest_size, self.file_size, self.alignment, self.reserved, self.checksum,
        )


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


def _checksum(header_prefix: bytes, manifest_bytes: bytes | memoryview) -> bytes:
    hasher = xxhash.xxh3_128()
    hasher.update(header_prefix)
    hasher.update(manifest_bytes)
    return hasher.digest()


# --------------------------------------------------------------------------
# Reading


def _has_lone_surrogate(text: str) -> bool:
    return any("\ud800" <= char <= "\udfff" for char in text)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise BundleError(f"manifest has a duplicate key {key!r}")
        if _has_lone_surrogate(key) or (isinstance(value, str) and _has_lone_surrogate(value)):
            raise BundleError("manifest contains a string with a lone surrogate, which is not valid Unicode")
        result[key] = value
    return result


def _reject_constant(name: str) -> None:
    raise BundleError(f"manifest contains {name}, which is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BundleError(f"manifest contains the number {text[:20]}, which is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 20:  # beyond int64: refused before Python parses a huge number
        raise BundleError(f"manifest contains an integer of {len(text)} digits, which is out of range")
    return int(text)


def _strings_are_unicode(data: Any) -> None:
    """Lone surrogates in list items (object values are checked while parsing)."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            for entry in item:
                if isinstance(entry, str) and _has_lone_surrogate(entry):
                    raise BundleError("manifest contains a string with a lone surrogate, which is not valid Unicode")
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())


def parse_manifest_bytes(raw: bytes) -> Manifest:
    """Strict UTF-8, strict JSON, no duplicate keys, then schema checks."""
    try:
        text = raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as error:
        raise BundleError(f"manifest is not valid UTF-8 (byte {error.start})") from None
    try:
        data = json.loads(
            text, object_pairs_hook=_reject_duplicate_keys, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int,
        )
    except json.JSONDecodeError as error:
        raise BundleError(f"manifest is not valid JSON: {error.msg} at position {error.pos}") from None
    except RecursionError:
        raise BundleError("manifest JSON is nested too deeply") from None
    except ValueError as error:  # anything else the parser refuses
        raise BundleError(f"manifest is not valid JSON: {error}") from None
    _strings_are_unicode(data)
    return manifest_from_json(data)


def _parse_header(raw: bytes, file_size: int) -> Header:
    if file_size < HEADER_SIZE:
        raise BundleError(f"file is {file_size} bytes, too short for a bundle header ({HEADER_SIZE} bytes)")
    magic, *fields = HEADER.unpack(raw[:HEADER_SIZE])
    if magic != MAGIC:
        raise BundleError("not a cuda-runner bundle (bad magic number)")
    header = Header(*fields)
    if header.major != FORMAT_MAJOR:
        newer = "a newer" if header.major > FORMAT_MAJOR else "an unknown"
        raise BundleError(
            f"bundle format version {header.major}.{header.minor} is {newer} major version; "
            f"this cuda-runner reads {FORMAT_MAJOR}.x"
        )
    _check_header_fields(header, file_size)
    return header


def _check_header_fields(header: Header, file_size: int) -> None:
    if header.header_size != HEADER_SIZE:
        raise BundleError(f"header field header_size is {header.header_size}, expected {HEADER_SIZE}")
    if header.manifest_offset != HEADER_SIZE:
        raise BundleError(f"header field manifest_offset is {header.manifest_offset}, expected {HEADER_SIZE}")
    if header.file_size != file_size:
        raise BundleError(f"header field file_size says {header.file_size} bytes but the file has {file_size}: it was cut short or added to on "
                          "its way here (an interrupted copy or download); copy it again from where it was built")
    if not MIN_ALIGNMENT <= header.alignment <= MAX_ALIGNMENT or header.alignment & (header.alignment - 1):
        raise BundleError(f"header field alignment {header.alignment} is not a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
    if header.reserved != 0:
        raise BundleError("header field reserved is not zero")
    if header.manifest_size == 0 or header.manifest_size > MAX_MANIFEST_SIZE:
        raise BundleError(f"header field manifest_size {header.manifest_size} is outside (0, {MAX_MANIFEST_SIZE}]")
    if header.manifest_offset + header.manifest_size > file_size:
        raise BundleError("header field manifest_size runs past the end of the file")


def _check_layout(header: Header, segments: tuple[SegmentEntry, ...], file_size: int) -> list[tuple[int, int]]:
    """Bounds, alignment, order and overlap of segments; returns the padding gaps."""
    if len(segments) > MAX_SEGMENTS:
        raise BundleError(f"bundle has {len(segments)} segments, more than the limit of {MAX_SEGMENTS}")
    names = [entry.name for entry in segments]
    if len(set(names)) != len(names):
        raise BundleError("bundle has two segments with the same name")
    gaps = []
    cursor = header.manifest_offset + header.manifest_size
    for entry in segments:
        if entry.offset % header.alignment:
            raise BundleError(f"segment {entry.name!r} starts at {entry.offset}, not a multiple of {header.alignment}")
        if entry.offset < cursor:
            raise BundleError(f"segment {entry.name!r} overlaps the manifest or the previous segment, or segments are out of order")
        if entry.offset - cursor >= header.alignment:
            raise BundleError(f"segment {entry.name!r} is preceded by more padding than the alignment needs")
        if entry.offset + entry.size > file_size:
            raise BundleError(f"segment {entry.name!r} runs past the end of the file")
        gaps.append((cursor, entry.offset))
        cursor = entry.offset + entry.size
    if cursor != file_size:
        raise BundleError(f"{file_size - cursor} unexpected bytes after the last segment")
    return gaps


class BundleReader:
    """A bundle opened for reading, memory-mapped, with its manifest checked.

    Opening checks the header, the header-and-manifest checksum, the segment
    layout and the padding. Segment digests are checked when a segment is
    read through `segment(name, verify=True)` or by `verify_all()`.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._file: BinaryIO | None = None
        self._map: mmap.mmap | None = None
        self._verified: set[str] = set()
        self._checks = OneCheckEach()
        self.signature: SignedFile | None = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        self._file = _open_regular_file(self.path)
        file_size = os.fstat(self._file.fileno()).st_size
        if file_size < HEADER_SIZE:
            raise BundleError(f"file is {file_size} bytes, too short for a bundle header ({HEADER_SIZE} bytes)")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        prefix = self._map[:HEADER_SIZE]
        self.header = _parse_header(prefix, file_size)
        manifest_end = self.header.manifest_offset + self.header.manifest_size
        manifest_bytes = self._map[self.header.manifest_offset:manifest_end]
        self._parsed_prefix = prefix + manifest_bytes  # what was parsed: a signature must cover exactly these bytes
        expected = _checksum(self._map[:CHECKSUMMED_HEADER_BYTES], manifest_bytes)
        if expected != self.header.checksum:
            raise BundleError("header checksum does not match: the header or manifest is damaged")
        self.manifest = parse_manifest_bytes(manifest_bytes)
        for start, end in _check_layout(self.header, self.manifest.segments, file_size):
            if self._map[start:end].count(0) != end - start:
                raise BundleError(f"padding at bytes [{start}, {end}) is not zero")
        self.file_size = file_size

    def require_signature(self, keys: Sequence[TrustedKey]) -> SignedFile:
        """Check the detached signature (`<bundle>.sig`) against trusted keys, and
        the header and manifest already read against it. From then on, every
        segment read with verification is also checked against the signature."""
        if self._map is None:
            raise BundleError("bundle is closed")
        signed = read_signature(signature_path(self.path), self.file_size, keys)
        manifest_end = self.header.manifest_offset + self.header.manifest_size
        # The bytes parsed at open must be the signed ones: checked on a private copy.
        with self._named_mismatch():
            signed_prefix = signed.extract_checked(memoryview(self._map), 0, manifest_end, "the bundle's header and manifest")
        if signed_prefix != self._parsed_prefix:
            raise BundleError("the bundle's header and manifest changed while it was opened")
        signed.prefetch(memoryview(self._map))  # hash the rest while the caller loads
        self.signature = signed
        return signed

    @property
    def version(self) -> str:
        return f"{self.header.major}.{self.header.minor}"

    def identity(self) -> str:
        """The digest of the header and manifest: the manifest names every
        segment with its digest, so no two bundles of other contents share it."""
        return f"bundle:{segment_digest(self._parsed_prefix)}"

    def _entry(self, name: str) -> SegmentEntry:
        entry = self.manifest.segment(name)
        if entry is None:
            raise BundleError(f"bundle has no segment {name!r}")
        return entry

    def segment(self, name: str, *, verify: bool = True) -> memoryview:
        """A zero-copy view of a segment, its digest checked unless verify=False."""
        if self._map is None:
            raise BundleError("bundle is closed")
        entry = self._entry(name)
        view = memoryview(self._map)[entry.offset:entry.offset + entry.size]
        if verify and name not in self._verified:
            self._check_digest(entry, view)
        return view

    def read_verified(self, name: str) -> bytes:
        """A private copy of a segment, checked after copying.

        The model library is loaded from this copy, so the bytes that were
        checked are exactly the bytes that get loaded, even if the file
        changes underneath the mapping.
        """
        entry = self._entry(name)
        end = entry.offset + entry.size
        if self.signature is None:
            data = bytes(self.segment(name, verify=False))
        elif self._map is None:
            raise BundleError("bundle is closed")
        else:
            # The bytes checked against the signature are the bytes returned (and loaded).
            with self._named_mismatch():
                data = self.signature.extract_checked(memoryview(self._map), entry.offset, end, f"segment {entry.name!r}")
        # A signature's SHA-256 already vouches for these bytes; the digest is for unsigned bundles.
        if self.signature is None and segment_digest(data) != entry.digest:
            raise BundleError(f"segment {entry.name!r} is damaged: its digest does not match")
        self._verified.add(entry.name)
        return data

    def verify_in_background(self, name: str) -> Future[None]:
        """Check a segment's digest on other threads while the caller goes on
        (the weights are checked while they are being loaded); the future
        raises BundleError on a mismatch."""
        return self._checks.start(name, self._check_digest, self._entry(name), self.segment(name, verify=False))

    def _check_digest(self, entry: SegmentEntry, data: bytes | memoryview) -> None:
        if self.signature is not None and self._map is not None:
            # SHA-256 of the signed shards: stronger than the digest, which is skipped.
            with self._named_mismatch():
                self.signature.check_range(memoryview(self._map), entry.offset, entry.offset + entry.size, f"segment {entry.name!r}", mapped=True)
        elif segment_digest(data) != entry.digest:
            raise BundleError(f"segment {entry.name!r} is damaged: its digest does not match")
        self._verified.add(entry.name)

    @contextlib.contextmanager
    def _named_mismatch(self) -> Iterator[None]:
        """A signed range that does not match names what in it changed (see _changed_part)."""
        try:
            yield
        except SignatureMismatch as mismatch:
            raise self._changed_part(mismatch) from None

    def _changed_part(self, mismatch: SignatureMismatch) -> BundleError:
        """One signed range (16 MiB by default, or the whole file) holds the header, the manifest
        and segments alike: say which of them changed, not the first thing that was checked. A
        segment whose bytes no longer have the digest the manifest records is what changed;
        where every segment in the range still has its digest, the header or manifest did."""
        manifest_end = self.header.manifest_offset + self.header.manifest_size
        changed = [entry.name for entry in self.manifest.segments
                   if entry.offset < mismatch.end and mismatch.start < entry.offset + entry.size and not self._has_its_digest(entry)]
        covers_manifest = mismatch.start < manifest_end
        if changed:
            names = ", ".join(repr(name) for name in changed)
            manifest = "the manifest (covered by the same signed bytes)" if covers_manifest else "the signed manifest"
            if len(changed) == 1:
                return BundleError(f"segment {names} does not match its signature: its bytes differ from its digest in {manifest}; "
                                   "the bundle changed after it was signed")
            return BundleError(f"segments {names} do not match their signature: their bytes differ from their digests in {manifest}; "
                               "the bundle changed after it was signed")
        if covers_manifest:
            return BundleError("the bundle's header and manifest do not match their signature: the bundle changed after it was signed")
        return mismatch

    def _has_its_digest(self, entry: SegmentEntry) -> bool:
        if self._map is None:
            return True  # closed meanwhile: nothing to tell
        return segment_digest(memoryview(self._map)[entry.offset:entry.offset + entry.size]) == entry.digest

    def verify_all(self) -> dict[str, bool]:
        """Re-check every segment digest; {name: ok}."""
        results = {}
        for entry in self.manifest.segments:
            self._verified.discard(entry.name)
            self._checks.forget(entry.name)
            try:
                self.segment(entry.name, verify=True)
                results[entry.name] = True
            except BundleError:
                results[entry.name] = False
        return results

    def close(self) -> None:
        if self.signature is not None:
            self.signature.cancel()  # no thread may still read the mapping
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
                self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_regular_file(path: Path) -> BinaryIO:
    return open_regular(path, "a bundle", not_regular=BundleError)


def open_bundle(path: str | os.PathLike[str]) -> BundleReader:
    return BundleReader(path)


def read_manifest(path: str | os.PathLike) -> Manifest:
    with open_bundle(path) as reader:
        return reader.manifest


# --------------------------------------------------------------------------
# Writing


def _source_size(source: SegmentSource) -> int:
    if isinstance(source, (bytes, bytearray, memoryview)):
        return memoryview(source).nbytes
    return os.stat(source).st_size


def _chunks(source: SegmentSource) -> Iterator[memoryview]:
    if isinstance(source, (bytes, bytearray, memoryview)):
        view = memoryview(source).cast("B")
        for start in range(0, len(view), _COPY_CHUNK):
            yield view[start:start + _COPY_CHUNK]
        return
    with open(source, "rb") as handle:
        while chunk := handle.read(_COPY_CHUNK):
            yield memoryview(chunk)


def _layout(manifest: Manifest, sizes: Mapping[str, int], alignment: int) -> tuple[Manifest, bytes]:
    """Assign segment offsets. Digests are placeholders of their final length,
    so the manifest's size, and so every offset, is already final."""
    placeholder = f"{DIGEST_ALGORITHM}:{'0' * 32}"
    entries = tuple(SegmentEntry(name, 0, size, placeholder) for name, size in sizes.items())
    for _ in range(8):  # offsets grow the manifest, which can move offsets
        manifest = replace(manifest, segments=entries)
        encoded = _encode_manifest(manifest)
        cursor = HEADER_SIZE + len(encoded)
        placed = []
        for entry in entries:
            cursor = _align(cursor, alignment)
            placed.append(replace(entry, offset=cursor))
            cursor += entry.size
        if tuple(placed) == entries:
            return manifest, encoded
        entries = tuple(placed)
    raise AssertionError("segment layout did not converge")


def _encode_manifest(manifest: Manifest) -> bytes:
    return json.dumps(manifest.to_json(), ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def write_bundle(
    path: str | os.PathLike,
    manifest: Manifest,
    segments: Mapping[str, SegmentSource],
    *,
    alignment: int = DEFAULT_ALIGNMENT,
) -> Path:
    """Write a bundle atomically: a temp file beside `path`, fsync, rename.

    `segments` maps names to bytes or to files, which are streamed so that
    multi-GB weights never sit in memory. The manifest's `segments` field is
    filled in here; whatever it held is ignored.
    """
    path = Path(path)
    if len(segments) > MAX_SEGMENTS:
        raise InputError(f"a bundle holds at most {MAX_SEGMENTS} segments")
    sizes = {name: _source_size(source) for name, source in segments.items()}
    manifest, encoded = _layout(manifest, sizes, alignment)
    if len(encoded) > MAX_MANIFEST_SIZE:
        raise InputError(f"manifest is {len(encoded)} bytes, over the limit of {MAX_MANIFEST_SIZE}")
    # Validate what we are about to write with the same code that reads it:
    # a manifest the reader would refuse is the caller's error, not a bad bundle.
    try:
        manifest_from_json(json.loads(encoded))
    except BundleError as error:
        raise InputError(f"the manifest to write is invalid: {error}") from None
    try:
        return write_file(path, lambda handle: _write_contents(handle, manifest, len(encoded), segments, alignment))
    except OSError as error:
        raise os_error(error, f"cannot write bundle {path}", WriteError) from error


def _write_contents(handle: BinaryIO, manifest: Manifest, manifest_size: int, segments: Mapping[str, SegmentSource], alignment: int) -> None:
    digests = _write_segments(handle, manifest, segments)
    final = replace(manifest, segments=tuple(replace(entry, digest=digests[entry.name]) for entry in manifest.segments))
    encoded = _encode_manifest(final)
    # Real digests have the placeholders' length, so no offset moves.
    if final.segments and len(encoded) != manifest_size:
        raise AssertionError("manifest size changed when digests were filled in")
    file_size = handle.seek(0, os.SEEK_END)
    header = Header(FORMAT_MAJOR, FORMAT_MINOR, HEADER_SIZE, HEADER_SIZE, len(encoded), file_size, alignment, 0, bytes(16))
    header = replace(header, checksum=_checksum(header.pack()[:CHECKSUMMED_HEADER_BYTES], encoded))
    handle.seek(0)
    handle.write(header.pack())
    handle.write(encoded)


def _write_segments(handle: BinaryIO, manifest: Manifest, segments: Mapping[str, SegmentSource]) -> dict[str, str]:
    """Write every segment at its offset (the gaps stay zero) and digest it on the way."""
    digests = {}
    for entry in manifest.segments:
        handle.seek(entry.offset)
        hasher = TreeHasher()
        written = 0
        for chunk in _chunks(segments[entry.name]):
            hasher.update(chunk)
            handle.write(chunk)
            written += len(chunk)
        if written != entry.size:
            raise WriteError(f"segment {entry.name!r} changed size while it was written")
        digests[entry.name] = hasher.hexdigest()
    # A trailing empty segment would otherwise leave the file short of its end.
    if manifest.segments:
        last = manifest.segments[-1]
        handle.truncate(last.offset + last.size)
    return digests
