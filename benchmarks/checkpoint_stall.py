"""What a checkpoint costs the training loop: the time `Saver.save` blocks the loop, with the write in the
background (fastbert's checkpoints) and waited for in the loop (as checkpoints were written before).

    python benchmarks/checkpoint_stall.py [--model base] [--optimizer adamw] [--repeats 3] [--device cpu]

Builds the run as `fastbert pretrain` does (the built-in corpus, the model and optimizer with its
state), then saves checkpoints alternately in both modes, side by side in one process, and prints the
median wall time each blocks the loop, the process's CPU time meanwhile (on a shared machine the
figures to trust: the ratio of the walls, both modes running under the same load, and the CPU times),
and the ratio.
"""
import argparse
import os
import statistics
import tempfile
import time

import torch

from fastbert.train import pretrain, state
from fastbert.train.run import build_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="base")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cfg = pretrain.PretrainConfig(out=out, model=args.model, optimizer=args.optimizer, device=args.device,
                                      steps=1000, keep_checkpoints=2, progress=False)
        run = build_run(cfg, {"vocab_size": 30522})
        try:
            state._create_optimizer_state(run.optimizer)
            sizes = [t.numel() * t.element_size() for t in run.model.parameters()]
            sizes += [t.numel() * t.element_size() for s in run.optimizer.state.values() for t in s.values()]
            saver, progress = state.Saver(run), state.start(run)
            saver.save(progress)  # warm-up: allocates the host buffers
            saver.wait()
            times = {"background write (now)": [], "write in the loop (before)": []}
            cpu = {mode: [] for mode in times}
            for repeat in range(args.repeats):
                for mode in times:
                    progress.step += 1
                    begin, begin_cpu = time.perf_counter(), time.process_time()
                    saver.save(progress)
                    if mode.startswith("write in the loop"):
                        saver.wait()
                    times[mode].append(time.perf_counter() - begin)
                    cpu[mode].append(time.process_time() - begin_cpu)
                    saver.wait()
            saver.close()
        finally:
            run.close()
        print(f"checkpoint of {args.model} + {args.optimizer} state: {sum(sizes) / 1e9:.2f} GB, device "
              f"{run.env.device}, torch {torch.__version__}, {os.cpu_count()} CPUs, median of {args.repeats}")
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        for mode, value in medians.items():
            print(f"  {mode:28s} {value:7.3f} s blocked, {statistics.median(cpu[mode]):6.3f} CPU-s of the process "
                  f"meanwhile  (runs: {', '.join(f'{v:.3f}' for v in times[mode])} s)")
        before, now = medians["write in the loop (before)"], medians["background write (now)"]
        print(f"  the loop waits {before / now:.1f}x less")


if __name__ == "__main__":
    main()
