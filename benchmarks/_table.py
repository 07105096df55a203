"""Shared output of the benchmarks: print a markdown table and write it to a file."""


def emit(rows: list[str], out: str | None) -> None:
    text = "\n".join(rows)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
