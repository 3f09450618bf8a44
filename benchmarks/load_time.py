"""from_pretrained: fastbert against transformers on the same BERT checkpoint, side by side in one process.

Run from the repository root: `python benchmarks/load_time.py [--size base|large|tiny] [--repeats 7]`.
It saves a randomly initialised transformers BertForPreTraining of that size to a temporary directory,
then loads it alternately with transformers' and fastbert's from_pretrained, timing each load in CPU time
of this process (time.process_time, one torch thread), so other work on the machine does not count.
Prints the median and the fastest load of each and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

SIZES = {"tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
         "base": dict(), "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                       intermediate_size=4096)}


def cpu_seconds(load) -> float:
    start = time.process_time()
    model = load()
    elapsed = time.process_time() - start
    assert next(model.parameters()).device.type == "cpu"
    return elapsed


def main() -> None:
    import transformers

    import fastbert

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="base")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as path:
        transformers.BertForPreTraining(transformers.BertConfig(**SIZES[args.size])).save_pretrained(path)
        loaders = {"transformers": lambda: transformers.BertForPreTraining.from_pretrained(path),
                   "fastbert": lambda: fastbert.BertForPreTraining.from_pretrained(path)}
        for load in loaders.values():  # warm-up: imports, first file reads
            load()
        times = {name: [] for name in loaders}
        for _ in range(args.repeats):
            for name, load in loaders.items():
                times[name].append(cpu_seconds(load))
    print(f"BertForPreTraining ({args.size}) from_pretrained, CPU seconds of this process, one torch thread, "
          f"{args.repeats} alternating loads (torch {torch.__version__}, transformers {transformers.__version__})")
    for name, values in times.items():
        print(f"  {name:12s} median {statistics.median(values) * 1e3:7.1f} ms   fastest {min(values) * 1e3:7.1f} ms")
    ratio = statistics.median(times["fastbert"]) / statistics.median(times["transformers"])
    print(f"  fastbert / transformers (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
