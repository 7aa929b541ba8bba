"""Every flag the README and docs/ mention exists (issue 61): a command line of ``train.py``,
``translate.py`` or another tinytf command in the docs uses only that command's options, and
a flag named in the prose is an option of a tinytf command, of a script in bench/, examples/
or scripts/, or of the named outside tools below. A renamed or removed option fails here
until the docs follow."""
import argparse
import re
from pathlib import Path

from tinytf.commands import average, bpe, prepare, train, translate

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "examples" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]          # docs/experiments/ are dated logs
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
OUTSIDE = {
    "--allow-run-as-root", "--oversubscribe", "--mca", "--hostfile",   # Open MPI's mpirun
    "--ntasks-per-node", "--mpi", "--requeue", "--signal",             # Slurm's sbatch/srun
    "--all", "--parsable",                                            # Slurm's sacct
    "--force-reinstall", "--no-binary",                                # pip
    "--random-source",                                                 # GNU shuf
    "--path", "--models",                                              # fairseq's, Sockeye's
    "--save-interval", "--min-updates",     # fairseq's (epochs) and Sockeye's, named in prose
}
"""Outside tools' options that the docs name; allowed in prose, never on a tinytf command line."""


def parser_flags(parser) -> set:
    flags = set()
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:       # a renamed option is not to be documented
            flags.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= parser_flags(sub)
    return flags


COMMANDS = {name: parser_flags(module.build_parser()) for name, module in (
    ("train", train), ("translate", translate), ("average", average), ("prepare", prepare),
    ("bpe", bpe))}
PATTERNS = {"train": r"\btrain\.py\b|tinytf-train\b",
            "translate": r"translate\.py\b|tinytf-translate\b",
            "average": r"tinytf-average\b|commands\.average\b",
            "prepare": r"tinytf-prepare\b|commands\.prepare\b",
            "bpe": r"tinytf-bpe\b|commands\.bpe\b"}


def script_flags() -> set:
    """The options of the scripts in bench/, examples/ and scripts/ (their add_argument calls)."""
    flags = set()
    for path in [*ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("scripts/*.py")]:
        flags |= set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', path.read_text()))
    return flags


def command_lines(text: str):
    """(line number, command line) of the code blocks, continuation lines joined."""
    inside, start, parts = False, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside, parts = not inside, []
            continue
        if not inside:
            continue
        if not parts:
            start = number
        parts.append(line.rstrip("\\").split(" #")[0])
        if not line.rstrip().endswith("\\"):
            yield start, " ".join(parts)
            parts = []


def test_every_command_line_in_the_docs_uses_its_commands_options():
    wrong = []
    for doc in DOCS:
        for number, line in command_lines(doc.read_text(encoding="utf-8")):
            for name, pattern in PATTERNS.items():
                match = re.search(pattern, line)
                if not match or "mpirun" in line[:match.start()] and name != "train":
                    continue
                tail = line[match.end():]
                for flag in FLAG.findall(tail):
                    if flag not in COMMANDS[name]:
                        wrong.append(f"{doc.relative_to(ROOT)}:{number}: {name}: {flag}")
                break
    assert not wrong, "\n".join(wrong)


def test_every_flag_the_docs_name_exists_somewhere():
    known = set().union(*COMMANDS.values()) | script_flags() | OUTSIDE
    unknown = [f"{doc.relative_to(ROOT)}:{number}: {flag}"
               for doc in DOCS
               for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
               for flag in FLAG.findall(line) if flag not in known]
    assert not unknown, "\n".join(unknown)
