"""Rebuild the shipped chat workloads, byte for byte: ``specdeploy/data/conversation.jsonl`` and ``structured.jsonl``.

Conversation: code-edit conversations over HumanEval's canonical solutions. Turn 1 gives a complete function
(HumanEval's prompt and canonical solution) and asks for a change; each later turn sends the conversation so far,
earlier answers included, and asks for another, so an answer copies earlier code. The earlier answers are made
here by deterministic edits (never model output): every configuration a benchmark compares, and every run,
sees the same prompts. Structured: requests for JSON records with repeated keys, over data written here.

    python -m tools.make_workloads [--out specdeploy/data]

One JSON object a line, in the format ``specdeploy.workloads.load_prompts`` reads: ``id``, ``category``,
``messages`` (the chat so far, ending with the user's message); a conversation's lines also carry ``conversation``
and ``turn``, its turns in order.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from pathlib import Path

from tools import arguments

ROOT = Path(__file__).resolve().parents[1]
TURNS = 3
# HumanEval tasks of one function, complete code of 500 to 800 characters: a third turn (three copies of the code)
# is at most 793 tokens of Qwen2.5-Coder's chat template, inside make demo's 2,048-token artifact with room to
# answer; each with a new name for the function and one of its local variables
TASKS = {
    "HumanEval/0": ("has_close_pair", "distance", "gap"),
    "HumanEval/3": ("balance_goes_negative", "op", "operation"),
    "HumanEval/6": ("max_nesting_depths", "max_depth", "deepest"),
    "HumanEval/9": ("running_maximum", "result", "maxima"),
    "HumanEval/12": ("longest_string", "maxlen", "max_length"),
    "HumanEval/19": ("sort_number_words", "value_map", "word_to_digit"),
    "HumanEval/37": ("sort_even_indices", "ans", "merged"),
    "HumanEval/59": ("max_prime_factor", "largest", "best"),
}
# an annotation's isinstance check and how its error names the expected type
CHECKS = {"str": ("str", "a string"), "int": ("int", "an integer"), "float": ("(int, float)", "a number"),
          "list": ("list", "a list")}


# ---------------------------------------------------------------- code edits, each a function of the code alone

def _function(code: str) -> ast.FunctionDef:
    (function,) = [node for node in ast.parse(code).body if isinstance(node, ast.FunctionDef)]
    return function


def rename_function(code: str, new: str) -> str:
    """The function renamed where it is called (its def and its doctest examples): ``name(``, not the word in prose."""
    old = _function(code).name
    return re.sub(rf"\b{re.escape(old)}\(", f"{new}(", code)


def rename_variable(code: str, old: str, new: str) -> str:
    """Every use of the variable ``old`` renamed, found by the parser: never inside a string or another name."""
    lines = code.split("\n")
    names = sorted((node.lineno, node.col_offset) for node in ast.walk(ast.parse(code))
                   if isinstance(node, ast.Name) and node.id == old)
    assert names, f"{old}: not a variable of the code"
    for lineno, column in reversed(names):  # from the end: earlier columns stay where they were
        line = lines[lineno - 1]
        lines[lineno - 1] = line[:column] + new + line[column + len(old):]
    return "\n".join(lines)


def one_line_docstring(code: str) -> str:
    """The docstring cut to its first sentence, on one line, without its examples."""
    docstring = _function(code).body[0]
    text = docstring.value.value.split(">>>")[0]
    summary = " ".join(text.split())
    summary = summary[: summary.index(". ") + 1] if ". " in summary else summary
    lines = code.split("\n")
    lines[docstring.lineno - 1 : docstring.end_lineno] = [" " * docstring.col_offset + f'"""{summary}"""']
    return "\n".join(lines)


def validate_inputs(code: str) -> str:
    """A TypeError naming the argument, after the docstring, for each argument whose annotation says its type."""
    function = _function(code)
    docstring = function.body[0]
    indent = " " * docstring.col_offset
    checks = []
    for argument in function.args.args:
        annotation = ast.unparse(argument.annotation).split("[")[0].lower()  # List[int] -> list
        kind, said = CHECKS[annotation]
        name = argument.arg
        checks += [f"{indent}if not isinstance({name}, {kind}):",
                   f'{indent}    raise TypeError(f"{name}: expected {said}, got {{type({name}).__name__}}")']
    lines = code.split("\n")
    lines[docstring.end_lineno : docstring.end_lineno] = checks
    return "\n".join(lines)


# ---------------------------------------------------------------- conversations

def _edits(task_id: str) -> list[tuple[str, str, Callable[[str], str]]]:
    """(what the user asks, how the answer begins, the edit) for each change a conversation may ask for."""
    name, old, new = TASKS[task_id]
    return [
        (f"Rename the function to `{name}`, in its docstring examples too.",
         f"Here is the function renamed to `{name}`:", lambda code: rename_function(code, name)),
        ("Shorten the docstring to one line: its first sentence, without the examples.",
         "Here is the code with a one-line docstring:", one_line_docstring),
        ("Add input validation at the start of the function: raise a TypeError that names the argument when an "
         "argument has the wrong type.", "Here is the code with input validation:", validate_inputs),
        (f"Rename the variable `{old}` to `{new}`.", f"Here is the code with `{old}` renamed to `{new}`:",
         lambda code: rename_variable(code, old, new)),
    ]


def _block(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def conversations(records: list[dict]) -> list[dict]:
    """One record per turn, each conversation's turns in order: conversation ``c`` asks for the edits from the
    ``c``-th on (rotating), so the conversations do not all ask for the same change first."""
    by_id = {record["task_id"]: record for record in records}
    lines = []
    for number, task_id in enumerate(TASKS):
        record = by_id[task_id]
        raw = (record["prompt"] + record["canonical_solution"]).split("\n")
        code = "\n".join(line.rstrip() for line in raw).strip("\n") + "\n"
        edits = _edits(task_id)
        edits = (edits[number % len(edits):] + edits[: number % len(edits)])[:TURNS]
        messages = []
        for turn, (ask, answer, edit) in enumerate(edits, 1):
            if turn == 1:
                ask = f"Here is a Python function:\n\n{_block(code)}\n\n{ask} Reply with the whole updated code."
            else:
                ask = f"{ask} Reply with the whole updated code again."
            messages.append({"role": "user", "content": ask})
            lines.append({"id": f"{task_id}/turn-{turn}", "category": "turn_1" if turn == 1 else "later_turns",
                          "conversation": task_id, "turn": turn, "messages": list(messages)})
            code = edit(code)
            ast.parse(code)  # every answer is valid Python
            messages.append({"role": "assistant", "content": f"{answer}\n\n{_block(code)}"})
    return lines


# ---------------------------------------------------------------- structured output

FIRST = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Niklaus", "Radia",
         "Tony", "Sophie", "John", "Karen", "Leslie"]
LAST = ["Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen", "Thompson", "Hamilton", "Wirth",
        "Perlman", "Hoare", "Wilson", "Backus", "Jones", "Lamport"]
ROLES = ["engineer", "designer", "analyst", "manager", "researcher", "support"]
CITIES = [("Lisbon", "Portugal", 545_000, "Europe/Lisbon"), ("Nairobi", "Kenya", 4_397_000, "Africa/Nairobi"),
          ("Osaka", "Japan", 2_752_000, "Asia/Tokyo"), ("Quito", "Ecuador", 2_011_000, "America/Guayaquil"),
          ("Tallinn", "Estonia", 454_000, "Europe/Tallinn"), ("Perth", "Australia", 2_141_000, "Australia/Perth"),
          ("Montreal", "Canada", 1_762_000, "America/Toronto"), ("Pune", "India", 3_124_000, "Asia/Kolkata")]
PRODUCTS = ["desk lamp", "usb cable", "notebook", "water bottle", "keyboard", "monitor stand", "headphones",
            "backpack", "phone case", "mouse pad"]
BOOKS = [("The Left Hand of Darkness", "Ursula K. Le Guin", 1969, "science fiction", 304),
         ("Beloved", "Toni Morrison", 1987, "literary fiction", 324),
         ("The Name of the Rose", "Umberto Eco", 1980, "mystery", 536),
         ("Things Fall Apart", "Chinua Achebe", 1958, "literary fiction", 209),
         ("Dune", "Frank Herbert", 1965, "science fiction", 412),
         ("The Remains of the Day", "Kazuo Ishiguro", 1989, "literary fiction", 258),
         ("Gödel, Escher, Bach", "Douglas Hofstadter", 1979, "non-fiction", 777)]
SERVICES = ["auth", "billing", "search", "gateway"]
LEVELS = ["INFO", "WARN", "ERROR", "INFO", "DEBUG"]
MESSAGES = ["request served in 42 ms", "retrying upstream call", "token expired for user 1182", "cache miss for key q:77",
            "connection pool at 90%", "invoice 5521 generated", "slow query: 1.8 s", "health check passed"]
DEPARTMENTS = ["Finance", "Platform", "Sales", "Research"]


def _person(i: int) -> tuple[str, str]:
    return FIRST[(i * 5) % len(FIRST)], LAST[(i * 7 + 3) % len(LAST)]


def structured() -> list[dict]:
    """Eight requests for JSON records with repeated keys, each over data made here by index arithmetic."""
    data = _structured_data()
    asks = [
        ("people", "Return a JSON array of 6 objects with the keys id (1 to 6), name, email (first.last@example.com, "
                   f"lower case), role and active (true or false) for these people:\n\n{data['prose']}"),
        ("csv", "Convert this CSV to a JSON array of objects with the keys sku, name, price (a number), quantity "
                f"(an integer) and in_stock (true when quantity > 0):\n\n{data['csv']}"),
        ("table", "Convert this Markdown table to a JSON array of objects with the keys city, country, population "
                  f"(an integer) and timezone:\n\n{data['table']}"),
        ("logs", "Parse these log lines into a JSON array of objects with the keys timestamp, level, service and "
                 f"message:\n\n{data['logs']}"),
        ("orders", "Return these orders as a JSON array of objects with the keys order_id (an integer), customer, "
                   "items (an array of objects with the keys product, quantity and unit_price) and total (the sum "
                   f"of quantity x unit_price):\n\n{data['orders']}"),
        ("books", "Return a JSON array of objects with the keys title, author, year, genre and pages for these "
                  f"books:\n\n{data['books']}"),
        ("sensors", "Convert these semicolon-separated sensor readings to a JSON array of objects with the keys "
                    f"sensor_id, timestamp (ISO 8601), temperature_c and humidity_pct:\n\n{data['sensors']}"),
        ("staff", "Convert this tab-separated table to a JSON object that maps each department to an array of its "
                  "employees, each an object with the keys employee_id, first_name, last_name, salary (an integer) "
                  f"and start_date:\n\n{data['staff']}"),
    ]
    return [{"id": f"structured-{i}", "category": kind, "messages": [{"role": "user", "content": text}]}
            for i, (kind, text) in enumerate(asks, 1)]


def _structured_data() -> dict[str, str]:
    """The data each structured request is about, by name: people, a CSV, a table, log lines, orders, books, sensor
    readings and staff."""
    people = [_person(i) for i in range(6)]
    prose = "\n".join(f"- {first} {last}, {ROLES[i % len(ROLES)]}, {'active' if i % 3 else 'on leave'}"
                      for i, (first, last) in enumerate(people))
    csv = "sku,name,price,quantity\n" + "\n".join(
        f"SKU-{1040 + 13 * i},{PRODUCTS[i]},{4.5 + 3.25 * i:.2f},{(i * 7) % 5 * 12}" for i in range(8))
    table = "| city | country | population | timezone |\n|---|---|---|---|\n" + "\n".join(
        f"| {c} | {n} | {p:,} | {z} |" for c, n, p, z in CITIES)
    logs = "\n".join(f"2026-03-{4 + i // 3:02d}T{8 + i:02d}:{(17 * i) % 60:02d}:{(31 * i) % 60:02d}Z "
                     f"{LEVELS[i % len(LEVELS)]} [{SERVICES[i % len(SERVICES)]}] {MESSAGES[i]}" for i in range(8))
    orders = "\n".join(
        f"Order {7301 + i} from {' '.join(_person(i + 6))}: "
        + ", ".join(f"{1 + (i + j) % 3} x {PRODUCTS[(i * 3 + j) % len(PRODUCTS)]} at "
                    f"{4.5 + 3.25 * ((i * 3 + j) % len(PRODUCTS)):.2f}" for j in range(1 + i % 3))
        for i in range(6))
    books = "\n".join(f"{t} by {a} ({y}), {g}, {p} pages" for t, a, y, g, p in BOOKS)
    sensors = "sensor_id;time;temp;rh\n" + "\n".join(
        f"S-{(i % 3) + 1};2026-01-15 {9 + i // 3:02d}:{(i % 3) * 20:02d};{18.0 + (i * 1.7) % 6:.1f};{40 + (i * 11) % 35}"
        for i in range(9))
    staff = "id\tfirst\tlast\tdepartment\tsalary\tstarted\n" + "\n".join(
        f"E{210 + i}\t{first}\t{last}\t{DEPARTMENTS[i % 4]}\t{52000 + 3500 * ((i * 5) % 7)}\t20{18 + i % 7}-0{1 + i % 9}-1{i % 10}"
        for i, (first, last) in enumerate(_person(n + 2) for n in range(8)))
    return {"prose": prose, "csv": csv, "table": table, "logs": logs, "orders": orders, "books": books,
            "sensors": sensors, "staff": staff}


def write(out: Path) -> list[Path]:
    """Write conversation.jsonl and structured.jsonl into ``out``; returns their paths."""
    from specdeploy.workloads import humaneval_records

    written = []
    for name, lines in (("conversation.jsonl", conversations(humaneval_records())), ("structured.jsonl", structured())):
        path = out / name
        path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = arguments.parser(__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "specdeploy" / "data", help="the directory to write into")
    args = parser.parse_args()
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
