"""``python -m bench.serve_process PEAK_FILE serve ...``: ``python -m mlx_lily
serve ...`` (mlx-lm's server) with a watcher that writes the process's MLX
peak memory to PEAK_FILE once a second, so that ``bench --serve`` can report
each server's peak memory (a server stopped by a signal runs no exit hook);
where ``LILY_BENCH_SERVER_SPLIT`` names a file, also the split of its decode
steps' time (``bench.serve_split``) there."""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def watch(path: str, split_path: str = "", period_s: float = 1.0) -> None:
    import mlx.core as mx

    from bench import serve_split

    while True:
        if split_path:
            serve_split.write(split_path)
        peak = mx.get_peak_memory()
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"peak_memory_gb": peak / 2**30, "at": time.time()}, f)
        os.replace(tmp, path)
        time.sleep(period_s)


def main() -> None:
    path, argv = sys.argv[1], sys.argv[2:]
    split_path = os.environ.get("LILY_BENCH_SERVER_SPLIT", "")
    if split_path:
        from bench import serve_split

        serve_split.install()
    threading.Thread(target=watch, args=(path, split_path), daemon=True).start()
    from mlx_lily.__main__ import main as lily_main

    lily_main(argv)


if __name__ == "__main__":
    main()
