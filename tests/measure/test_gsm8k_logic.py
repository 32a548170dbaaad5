"""GSM8K answer extraction and data set checks (no server)."""

from __future__ import annotations

import json

import pytest

from magpie.measure import gsm8k
from tests.serving.helpers import run_tool

# --------------------------------------------------------------------------------------------
# GSM8K answer extraction and data set checks


@pytest.mark.parametrize(
    "reply, value, method",
    [
        ("She has 42 - 35 = 7 left.\n#### 7", 7.0, "hash"),
        ("Total: 1,800 pages.\n#### 1,800", 1800.0, "hash"),
        ("#### $28.", 28.0, "hash"),
        ("It is -4 + 11 = 7, so the answer is \\boxed{7}", 7.0, "boxed"),
        ("First 12, then 15, so 15 days in all.", 15.0, "last-number"),
        ("The temperature is -3 degrees", -3.0, "last-number"),
        ("I cannot tell.", None, "none"),
        ("#### 5 ... wait, let me redo it. #### 6", 6.0, "hash"),
    ],
)
def test_gsm8k_answer_extraction(reply, value, method):
    assert gsm8k.extract_answer(reply) == (value, method)


def test_gsm8k_fixture_references_parse(gsm8k_fixture):
    problems, digest = gsm8k.load_dataset(str(gsm8k_fixture))
    assert len(problems) == 12 and len(digest) == 64
    assert [p["reference"] for p in problems][:3] == [7.0, 15.0, 28.0]


def test_gsm8k_refuses_records_without_a_final_answer(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "2+2?", "answer": "four"}) + "\n")
    proc = run_tool("gsm8k", "--dataset", str(bad), "--url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "record 1" in proc.stderr and "####" in proc.stderr


def test_gsm8k_parquet_without_pyarrow_says_what_to_do(tmp_path):
    try:
        import pyarrow  # noqa: F401

        pytest.skip("pyarrow is installed here; the parquet path is then read by pyarrow itself")
    except ImportError:
        pass
    data = tmp_path / "test.parquet"
    data.write_bytes(b"PAR1")
    proc = run_tool("gsm8k", "--dataset", str(data), "--url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "needs pyarrow" in proc.stderr
