"""Metrics arithmetic on real-format pages (no server)."""

from __future__ import annotations

import pytest

from magpie.serving.metrics import MetricsSnapshot

# --------------------------------------------------------------------------------------------
# Metrics arithmetic on a real-format page

METRICS_BEFORE = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="tiny"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="tiny"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="tiny"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="1"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="tiny",position="2"} 6.0
"""


def test_spec_decode_figures_from_two_snapshots():
    after = (
        METRICS_BEFORE.replace("} 10.0", "} 20.0", 1)
        .replace("} 30.0", "} 60.0")
        .replace("} 25.0", "} 45.0")
        .replace('position="0"} 10.0', 'position="0"} 19.0')
        .replace('position="1"} 9.0', 'position="1"} 16.0')
        .replace('position="2"} 6.0', 'position="2"} 10.0')
    )
    figures = MetricsSnapshot.parse(after).spec_decode(MetricsSnapshot.parse(METRICS_BEFORE))
    assert figures["drafts"] == 10 and figures["draft_tokens"] == 30 and figures["accepted_tokens"] == 20
    assert figures["acceptance_length"] == pytest.approx(3.0)
    assert figures["acceptance_rate"] == pytest.approx(20 / 30)
    assert figures["per_position_acceptance"] == pytest.approx([0.9, 0.7, 0.4])
    assert figures["num_speculative_tokens"] == 3
    assert MetricsSnapshot.parse("vllm:generation_tokens_total 5.0\n").spec_decode(MetricsSnapshot()) is None


# Two engines, a sibling metric sharing the name's prefix, a timestamp, a histogram bucket with
# le="+Inf", an escaped label value and an unlabelled sample, as the exposition format allows.
METRICS_PAGE = r"""# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 120.0
vllm:generation_tokens_total{model_name="tiny",engine="1"} 80.0
vllm:generation_tokens_created{engine="0",model_name="tiny"} 1.7e+09
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0 1764590000000
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 4.0
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:cache_config_info{block_size="16",note="a \"quoted\" value"} 1.0
process_open_fds 9.0
"""
METRICS_PAGE_BEFORE = """vllm:generation_tokens_total{engine="0",model_name="tiny"} 100.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="tiny"} 1.0
vllm:request_decode_time_seconds_count{engine="0",model_name="tiny"} 1.0
"""


def test_metrics_snapshot_reads_a_hand_written_page():
    page = MetricsSnapshot.parse(METRICS_PAGE)
    assert page.sum("vllm:generation_tokens_total") == 200.0  # both engines
    assert page.sum("vllm:generation_tokens_total", engine="1") == 80.0
    assert page.sum("vllm:generation_tokens") is None  # a prefix is no metric
    assert page.sum("vllm:num_requests_running") == 2.0  # the timestamp is not the value
    assert page.sum("process_open_fds") == 9.0
    assert page.values("vllm:generation_tokens_total") == {
        '{engine="0",model_name="tiny"}': 120.0,
        '{engine="1",model_name="tiny"}': 80.0,  # labels in one order whatever the page's
    }
    assert page.label_values("vllm:cache_config_info", "note") == ['a "quoted" value']
    assert page.label_values("vllm:request_decode_time_seconds_bucket", "le") == ["+Inf"]
    assert "vllm:spec_decode_num_drafts_total" not in page and page.spec_decode() is None


def test_metrics_deltas_between_two_hand_written_pages():
    before, after = MetricsSnapshot.parse(METRICS_PAGE_BEFORE), MetricsSnapshot.parse(METRICS_PAGE)
    assert after.delta(before, "vllm:generation_tokens_total") == 100.0  # engine 1 counts from 0
    assert after.delta(before, "vllm:prompt_tokens_total") is None  # not exported
    # (200 - 100 generated - 2 first tokens of the 2 requests finished) / (4 - 1) s
    assert after.engine_decode_rate(before) == pytest.approx(98 / 3)
    assert after.counter_deltas(before) == {
        'vllm:generation_tokens_total{engine="0",model_name="tiny"}': 20.0,
        'vllm:generation_tokens_total{engine="1",model_name="tiny"}': 80.0,
    }
