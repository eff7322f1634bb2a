"""steerspec bench http: its summary of rounds and its refusals (the runs themselves are in the closing notes)."""

from __future__ import annotations

import argparse

import pytest

from steerspec.bench import http_api


def test_summary_per_api_from_rounds():
    rounds = [{"api": "grpc", "tokens": 10, "wall_s": 1.0, "throughput_tok_s": 10.0, "ttft_s": [0.1, 0.3],
               "tpot_s": [0.02, 0.04]},
              {"api": "http", "tokens": 10, "wall_s": 2.0, "throughput_tok_s": 5.0, "ttft_s": [0.2], "tpot_s": [0.05]},
              {"api": "http", "tokens": 10, "wall_s": 1.0, "throughput_tok_s": 10.0, "ttft_s": [0.4], "tpot_s": [0.07]}]
    s = http_api.summarise(rounds)
    assert s["grpc"]["tpot_ms_p50"] == pytest.approx(30.0) and s["grpc"]["ttft_ms_p50"] == pytest.approx(200.0)
    assert s["http"]["rounds"] == 2 and s["http"]["throughput_tok_s_mean"] == pytest.approx(7.5)
    assert (s["http"]["throughput_tok_s_min"], s["http"]["throughput_tok_s_max"]) == (5.0, 10.0)


def test_bad_arguments_exit_2(capsys):
    parser = argparse.ArgumentParser()
    http_api.add_arguments(parser)
    assert http_api.run(parser.parse_args(["--clients", "0"])) == 2
    assert "--clients" in capsys.readouterr().err
