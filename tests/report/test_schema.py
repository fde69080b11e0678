"""cuda_runner.report.schema: one versioned schema name per JSON document, all documented."""

from __future__ import annotations

import re

from helpers import ROOT

from cuda_runner.report.schema import SCHEMAS


def test_every_schema_is_named_after_its_document_with_a_major_version():
    assert set(SCHEMAS) == {"inspect", "run", "bench", "devices", "compare", "batch", "error"}
    for document, schema in SCHEMAS.items():
        assert re.fullmatch(rf"cuda-runner/{document}/[1-9][0-9]*", schema), schema


def test_every_schema_name_is_in_the_json_reference():
    reference = (ROOT / "docs" / "json.md").read_text()
    assert [schema for schema in SCHEMAS.values() if schema not in reference] == []
