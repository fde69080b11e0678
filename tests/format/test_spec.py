"""docs/bundle-format.md and the code must agree."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from forge import forge, method

from cuda_runner.format import bundle, digest, manifest, open_bundle

jsonschema = pytest.importorskip("jsonschema")  # not on every GPU machine

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "docs" / "bundle-format.md").read_text()
SCHEMA = json.loads((ROOT / "cuda_runner" / "format" / "manifest.schema.json").read_text())


def _documented_limits() -> dict[str, int]:
    section = SPEC.split("## Limits", 1)[1].split("##", 1)[0]
    return {name: int(value) for name, value in re.findall(r"^\| ([A-Z_]+) \| (\d+) \|$", section, re.MULTILINE)}


def test_documented_limits_match_the_code():
    limits = _documented_limits()
    code = {
        "HEADER_SIZE": bundle.HEADER_SIZE, "MIN_ALIGNMENT": bundle.MIN_ALIGNMENT, "MAX_ALIGNMENT": bundle.MAX_ALIGNMENT,
        "DEFAULT_ALIGNMENT": bundle.DEFAULT_ALIGNMENT, "MAX_MANIFEST_SIZE": bundle.MAX_MANIFEST_SIZE,
        "MAX_SEGMENTS": manifest.MAX_SEGMENTS, "MAX_CONSTANTS": manifest.MAX_CONSTANTS, "MAX_FQN_LENGTH": manifest.MAX_FQN_LENGTH,
        "MAX_METHODS": manifest.MAX_METHODS, "MAX_NAME_LENGTH": manifest.MAX_NAME_LENGTH,
        "MAX_METHOD_NAME_LENGTH": manifest.MAX_METHOD_NAME_LENGTH,
        "MAX_RANK": manifest.MAX_RANK, "MAX_TENSORS_PER_SIGNATURE": manifest.MAX_TENSORS_PER_SIGNATURE,
        "MAX_METADATA_ENTRIES": manifest.MAX_METADATA_ENTRIES, "MAX_METADATA_VALUE_LENGTH": manifest.MAX_METADATA_VALUE_LENGTH,
        "MAX_EXPRESSION_LENGTH": manifest.MAX_EXPRESSION_LENGTH, "DIGEST_CHUNK": digest.DIGEST_CHUNK,
    }
    assert limits == code


def test_documented_header_matches_the_code():
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (\w+) \|", SPEC.split("## Header", 1)[1].split("##", 1)[0], re.MULTILINE)
    layout = [(int(offset), int(size), field) for offset, size, field in rows]
    assert [field for _, _, field in layout] == ["magic", "major", "minor", "header_size", "manifest_offset", "manifest_size", "file_size", "alignment", "reserved", "checksum"]
    assert sum(size for _, size, _ in layout) == bundle.HEADER.size == bundle.HEADER_SIZE
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(layout))
    assert bytes.fromhex(re.search(r"`((?:[0-9A-F]{2} ){7}[0-9A-F]{2})`", SPEC).group(1).replace(" ", "")) == bundle.MAGIC
    assert f"| 8 | 2 | major | {bundle.FORMAT_MAJOR} |" in SPEC
    assert f"| 10 | 2 | minor | {bundle.FORMAT_MINOR} |" in SPEC
    assert bundle.CHECKSUMMED_HEADER_BYTES == 48 and "header bytes [0, 48)" in SPEC


def test_documented_dtypes_and_features_match_the_code():
    from cuda_runner.arrays import DTYPE_NAMES

    documented = re.search(r"one of `([a-z0-9 ]+)`", SPEC).group(1).split()
    assert sorted(documented) == sorted(DTYPE_NAMES)
    assert sorted(SCHEMA["$defs"]["dtype"]["enum"]) == sorted(DTYPE_NAMES)
    known = re.search(rf"Known\s+features in 1\.{bundle.FORMAT_MINOR}: ((?:`[\w-]+`(?:,\s+)?)+)", SPEC).group(1)
    assert set(re.findall(r"`([\w-]+)`", known)) == manifest.KNOWN_FEATURES


def test_schema_limits_match_the_code():
    defs = SCHEMA["$defs"]
    assert defs["name"]["maxLength"] == manifest.MAX_NAME_LENGTH
    assert SCHEMA["properties"]["segments"]["maxItems"] == manifest.MAX_SEGMENTS
    assert SCHEMA["properties"]["methods"]["maxProperties"] == manifest.MAX_METHODS
    assert defs["tensor"]["properties"]["shape"]["maxItems"] == manifest.MAX_RANK
    assert defs["signature"]["maxItems"] == manifest.MAX_TENSORS_PER_SIGNATURE


def test_real_manifests_validate_against_the_schema(dict_mlp_bundle, embedder_bundle):
    validator = jsonschema.Draft202012Validator(SCHEMA)
    validator.check_schema(SCHEMA)
    for path in (dict_mlp_bundle.path, embedder_bundle.path):
        with open_bundle(path) as reader:
            validator.validate(reader.manifest.to_json())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda m: m["methods"]["m"]["inputs"][0].update(dtype="complex64"),
        lambda m: m["methods"]["m"]["inputs"][0].update(name="a/b"),
        lambda m: m["methods"]["m"]["device"].update(type="tpu"),
        lambda m: m["methods"].clear(),
        lambda m: m["methods"]["m"].update(sample_inputs_segment="m_w"),
        lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds={"min": 0}),
        lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", bounds={"min": 0, "max": 1.5}),
        lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", span_bounds={"min": 0}),
        lambda m: m["methods"]["m"]["inputs"][0].update(dtype="int64", span_bounds={"min": 0, "max": 3, "step": 1}),
    ],
)
def test_schema_rejects_what_the_reader_rejects(tmp_path, mutate):
    from cuda_runner.errors import BundleError

    document = {"methods": {"m": method()}}
    mutate(document)
    path = tmp_path / "b.bundle"
    path.write_bytes(forge(document))
    with pytest.raises(BundleError):
        open_bundle(path)
    document["segments"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(document, SCHEMA)


def test_documented_digest_matches_the_code():
    assert f"`{digest.DIGEST_ALGORITHM}:` followed by 32" in SPEC
    assert SCHEMA["$defs"]["segment"]["properties"]["digest"]["pattern"] == f"^{digest.DIGEST_ALGORITHM}:[0-9a-f]{{32}}$"
