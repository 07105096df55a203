"""Shared output of the benchmarks: print a markdown table and write it to a file."""


def emit(rows: list[str], out: str | None) -> None:
    text = "\n".join(rows)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


class Log:
    """``log(line)`` prints a line at once and keeps it; ``log.write(path)`` writes every line kept."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, s: str = "") -> None:
        print(s, flush=True)
        self.lines.append(s)

    def write(self, path) -> None:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("\n".join(self.lines) + "\n")
