"""What scraping every node's load costs (issue 12): parsing vLLM's `/metrics`, and the control
plane with many nodes whose load is scraped every second.

    python -m bench.load_scrape [--nodes 100] [--seconds 20] [--pairs 3] [--parse-only]

1. parse: `parse_vllm_load` on a body shaped like a vLLM V1 engine's exposition (the request and
   cache gauges, 14 histograms of 23 buckets with their sums and counts, process and GC series),
   for one engine and for four (data parallel, each series once per engine): microseconds per
   body, best of five.
2. control plane: `bench.control_plane_load` with `--nodes` simulated nodes, alternately without
   and with `[routing] load_scrape_interval = "1s"`, `--pairs` times: CPU (% of one core) and
   events applied per second. The simulated node's `/metrics` is small (three gauges), so this is
   the cost of the scrapes' requests and events; (1) adds the parse of a real body.

Prints JSON. Quote medians of the pairs, and say how busy the machine was.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import timeit
from pathlib import Path

import bench.control_plane_load
from bench.processes import Processes, plan_cores
from controlplane.effects.probes import parse_vllm_load

_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0]
_BUCKETS += [40.0, 80.0, 160.0, 640.0, 2560.0, "+Inf"]
_GAUGES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]
_HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
]
_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def vllm_metrics_body(engines: int) -> bytes:
    """A `/metrics` body of vLLM's shape and size (values are placeholders)."""
    lines = []
    for name in ("python_gc_objects_collected_total", "python_gc_collections_total"):
        lines += [f"# HELP {name} Objects collected during gc", f"# TYPE {name} counter"]
        lines += [f'{name}{{generation="{generation}"}} 1234.0' for generation in range(3)]
    for name in ("process_virtual_memory_bytes", "process_resident_memory_bytes", "process_open_fds"):
        lines += [f"# HELP {name} Process figure.", f"# TYPE {name} gauge", f"{name} 1.2345e+09"]
    labels = [f'engine="{engine}",model_name="{_MODEL}"' for engine in range(engines)]
    for name in _GAUGES:
        lines += [f"# HELP {name} A gauge of the engine.", f"# TYPE {name} gauge"]
        lines += [f"{name}{{{label}}} 3.0" for label in labels]
    for name in _HISTOGRAMS:
        lines += [f"# HELP {name} Histogram of a request figure.", f"# TYPE {name} histogram"]
        for label in labels:
            lines += [f'{name}_bucket{{{label},le="{bucket}"}} 12345.0' for bucket in _BUCKETS]
            lines += [f"{name}_count{{{label}}} 12345.0", f"{name}_sum{{{label}}} 6789.125"]
    return ("\n".join(lines) + "\n").encode()


def measure_parse() -> list[dict]:
    figures = []
    for engines in (1, 4):
        body = vllm_metrics_body(engines)
        number = 1000
        best = min(timeit.repeat(lambda: parse_vllm_load(body), number=number, repeat=5)) / number
        figures.append({"engines": engines, "body_bytes": len(body), "microseconds": round(best * 1e6, 1)})
    return figures


def measure_control_plane(nodes: int, seconds: float, pairs: int) -> dict:
    """Alternate runs without and with the load scrape; each run's figures and the medians."""
    plain_config = bench.control_plane_load.control_plane_config

    def scraping_config(event_log: Path, described: list[dict]) -> str:
        return plain_config(event_log, described) + '[routing]\nload_scrape_interval = "1s"\n'

    runs: dict[str, list[dict]] = {"without": [], "with": []}
    with tempfile.TemporaryDirectory(prefix="interlock-bench-") as folder, Processes(Path(folder)) as processes:
        for _ in range(pairs):
            for kind, config in (("without", plain_config), ("with", scraping_config)):
                # measure_control_plane writes the config file through this module function.
                bench.control_plane_load.control_plane_config = config
                try:
                    figures = bench.control_plane_load.measure_control_plane(
                        processes, Path(folder), nodes=nodes, seconds=seconds, cores=plan_cores()
                    )
                finally:
                    bench.control_plane_load.control_plane_config = plain_config
                runs[kind].append(figures)
    medians = {
        kind: {
            key: statistics.median(run[key] for run in kind_runs)
            for key in ("core_percent", "events_per_second", "ready_nodes")
        }
        for kind, kind_runs in runs.items()
    }
    return {"nodes": nodes, "seconds": seconds, "pairs": pairs, "medians": medians, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.load_scrape", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100, help="simulated nodes (default 100)")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window of each run (default 20)")
    parser.add_argument("--pairs", type=int, default=3, help="runs without and with the scrape (default 3)")
    parser.add_argument("--parse-only", action="store_true", help="only the parse")
    args = parser.parse_args()
    result: dict = {"parse": measure_parse()}
    if not args.parse_only:
        result["control_plane"] = measure_control_plane(args.nodes, args.seconds, args.pairs)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
