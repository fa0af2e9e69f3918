#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# tests/docs/check_docs.py — the docs name only what exists. Reads README.md, DESIGN.md and benchmarks/README.md
# (CHANGELOG.md is history and may name what is gone) and fails, naming the document, the line and the missing
# thing, when one of them names
#  - a repository path (include/dml/..., examples/..., tests/..., scripts/..., benchmarks/..., tools/..., cmake/...,
#    packaging/..., .ci/...; also a header named from include/dml, such as `train/engine.hpp`) that is not there;
#  - a link to a heading (README.md#name, #name) that the target document does not have;
#  - a learn program (01_one_rank, learn_01_one_rank) that examples/learn does not hold, or a count of learn
#    programs ("nine programs") other than the folder's;
#  - a command-line flag that the program it is given to does not declare: flags in command lines (code blocks and
#    inline code) that run one of dml's programs (the examples, the learn programs, the tools, the benchmarks, the
#    repository's Python and shell scripts), and inline `--flag` mentions in a paragraph that names such a program.
#    A C++ program declares a flag with add("--x", ...) or add_switch("--x", ...) (dml/train/flags.hpp), a Python
#    script with add_argument("--x", ...), a shell script by spelling it.
# Usage: check_docs.py REPO_ROOT      (exit 0: every name exists; 1: the problems, one line each)
#        check_docs.py --self-test    (a fake repository whose docs name a missing file, flag, program and count
#                                      must fail, and its good docs must pass)
# Standard library only.
import glob
import os
import re
import shlex
import sys
import tempfile

DOCS = ["README.md", "DESIGN.md", "benchmarks/README.md"]

# Paths a doc may name before they land, with why; a note is printed while one is missing. Remove an entry once
# its path is in the tree.
PENDING = {}

ROOTS = r"(?:include/dml|examples|tests|scripts|benchmarks|tools|cmake|packaging|\.ci)"
# A path: its root, then characters up to a space, quote, bracket, '|', ',' ';' ':' or '#' (a link's anchor); a
# {a,b} group may hold commas. <placeholder> and * stand for any name.
PATH_BODY = r"(?:\{[^}\s]*\}|[^\s`'\"()\[\]|,;:#{}])*"
PATH_RE = re.compile(r"(?<![\w./-])(" + ROOTS + r"/" + PATH_BODY + r")")
# A header named from include/dml: `train/engine.hpp`, `dml/train/engine.hpp`, `nn/detail/*.cuh`.
HEADER_RE = re.compile(r"(?<![\w./-])(?:dml/)?((?:core|nn|comm|parallel|optim|train|plan|ps|ft)/" +
                       r"[\w*{},<>/.-]*\.(?:hpp|cuh|h))\b")
LINK_RE = re.compile(r"\]\(([^)\s]*)\)")
LEARN_RE = re.compile(r"(?:\blearn_|(?<![\w.-]))(\d\d)_([a-z][a-z0-9_]*)")
LEARN_NUMBER_RE = re.compile(r"\blearn_(\d\d)\b")
NUMBER_WORDS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
COUNT_RE = re.compile(r"\b(\d+|" + "|".join(NUMBER_WORDS) + r")\s+(?:[\w`/.-]+\s+){0,3}?programs\b", re.I)
FLAG_RE = re.compile(r"^--[A-Za-z0-9][\w-]*$")
CODE_SPAN_RE = re.compile(r"`([^`]+)`")

# Words that start a command and pass the next program its own flags: the program after them is the one run.
LAUNCHERS = {"mpirun", "mpiexec", "env", "timeout", "time", "exec", "nohup", "sudo", "do", "then", "else", "$",
             "python3", "/usr/bin/python3", "bash", "sh", "perf", "taskset", "numactl", "valgrind", "gdb", "--"}
# Commands that are not dml's: their flags are theirs. A paragraph that names one may give its flags alone.
FOREIGN = {"cmake", "ctest", "mpirun", "mpiexec", "git", "apt-get", "apt", "conan", "vcpkg", "cmp", "perf", "gcc",
           "g++", "clang++", "nvcc", "python3", "pip", "make", "ninja", "tar", "chroot", "mmdebstrap"}
# Flags of foreign tools that a paragraph may give without naming the tool.
FOREIGN_FLAGS = {"--preset", "--build", "--test-dir", "--target", "--install", "--prefix", "--allow-run-as-root",
                 "--oversubscribe", "--overlay-ports", "--no-install-recommends", "--output-on-failure",
                 "--help", "--version"}
# Shell scripts that hand their arguments to a program: they take its flags too.
FORWARDS = {"scripts/demo": "fashion_mnist", "benchmarks/large_batch.sh": "fashion_mnist"}


class Repo:
    """What exists in a repository: files, learn programs, and each program's flags."""

    def __init__(self, root):
        self.root = root
        self.learn = {}  # "01" -> "01_one_rank"
        for f in sorted(glob.glob(os.path.join(root, "examples", "learn", "[0-9][0-9]_*.cpp"))):
            stem = os.path.basename(f)[:-4]
            self.learn[stem[:2]] = stem
        self.programs = {}  # name -> set of flags
        self.match = {}     # name -> how a command names it: "base" (basename) or "path" (a path suffix)
        self._cpp_programs()
        self._scripts()

    def exists(self, rel):
        return os.path.exists(os.path.join(self.root, rel))

    def _read(self, files):
        text = []
        for f in files:
            try:
                with open(f, encoding="utf-8", errors="replace") as fh:
                    text.append(fh.read())
            except OSError:
                pass
        return "\n".join(text)

    def _add_cpp(self, name, files):
        src = self._read(files)
        flags = set(re.findall(r"\badd(?:_switch)?\s*\(\s*\"(--[A-Za-z0-9][\w-]*)\"", src))
        self.programs[name] = flags | {"--help"}
        self.match[name] = "base"

    def _cpp_programs(self):
        r = self.root
        ex = lambda d: [f for f in glob.glob(os.path.join(r, "examples", d, "*")) if f.endswith((".cpp", ".hpp"))]
        for name in ("fashion_mnist", "gpt", "param_server"):
            if os.path.isdir(os.path.join(r, "examples", name)):
                self._add_cpp(name, ex(name))
        if os.path.isdir(os.path.join(r, "examples", "fashion_mnist")):
            self._add_cpp("fashion_mnist_cuda", ex("fashion_mnist") + [os.path.join(r, "examples", "fashion_mnist", "main.cu")])
        for stem in self.learn.values():
            self._add_cpp("learn_" + stem, [os.path.join(r, "examples", "learn", stem + ".cpp")])
        for f in glob.glob(os.path.join(r, "tools", "*.cpp")):
            self._add_cpp(os.path.basename(f)[:-4], [f])
        common = glob.glob(os.path.join(r, "benchmarks", "*.hpp"))
        for f in glob.glob(os.path.join(r, "benchmarks", "*.cpp")):
            self._add_cpp(os.path.basename(f)[:-4], [f] + common)

    def _scripts(self):
        r = self.root
        pys = glob.glob(os.path.join(r, "benchmarks", "*.py")) + glob.glob(os.path.join(r, "tests", "**", "*.py"),
                                                                             recursive=True)
        for f in pys:
            rel = os.path.relpath(f, r)
            flags = set(re.findall(r"add_argument\(\s*\"(--[A-Za-z0-9][\w-]*)\"", self._read([f])))
            self.programs[rel] = flags | {"--help"}
            self.match[rel] = "path"
        shells = [f for f in glob.glob(os.path.join(r, "scripts", "*")) if os.path.isfile(f)]
        shells += glob.glob(os.path.join(r, "benchmarks", "*.sh")) + glob.glob(os.path.join(r, ".ci", "*"))
        for f in shells:
            rel = os.path.relpath(f, r)
            flags = set(re.findall(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)", self._read([f])))
            self.programs[rel] = flags | {"--help"}
            self.match[rel] = "path"
        for script, program in FORWARDS.items():
            if script in self.programs and program in self.programs:
                self.programs[script] |= self.programs[program]

    def program_of(self, token):
        """The program a command-line word runs, or None."""
        t = token.strip("[]()`'\",;")
        if not t or t.startswith("-"):
            return None
        base = t.rsplit("/", 1)[-1]
        for name, how in self.match.items():
            if how == "base" and base == name:
                return name
            if how == "path" and (t == name or t.endswith("/" + name) or
                                  ("." in base and base == name.rsplit("/", 1)[-1])):
                return name
        return None

    def flag_anywhere(self, flag):
        return any(flag in f for f in self.programs.values())


def is_foreign(token):
    t = token.strip("[]()`'\",;")
    return t.rsplit("/", 1)[-1] in FOREIGN


def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    out, seen = set(), {}
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    fence = False
    for line in lines:
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            out.add(s if n == 0 else f"{s}-{n}")
            seen[s] = n + 1
    return out


def expand(path):
    """{a,b} groups into their alternatives, <placeholders> into '*'."""
    path = re.sub(r"<[^>]*>", "*", path)
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    out = []
    for alt in m.group(1).split(","):
        out += expand(path[:m.start()] + alt + path[m.end():])
    return out


def path_exists(repo, rel):
    for p in expand(rel):
        if "*" in p or "?" in p:
            if glob.glob(os.path.join(repo.root, p)):
                return True
        elif repo.exists(p):
            return True
    return False


def clean_path(p):
    return p.rstrip(".")


class Checker:
    def __init__(self, repo):
        self.repo = repo
        self.problems = []
        self.notes = []
        self.learn_count = len(repo.learn)

    def problem(self, doc, line, text):
        self.problems.append(f"{doc}:{line}: {text}")

    # ---- names in any text ----
    def check_names(self, doc, n, text):
        repo = self.repo
        for m in PATH_RE.finditer(text):
            p = clean_path(m.group(1))
            if p.endswith("/") and p.count("/") == 1 and p[:-1] in ("examples", "tests", "scripts", "benchmarks",
                                                                     "tools", "cmake", "packaging", ".ci"):
                continue
            if not path_exists(repo, p):
                if p.rstrip("/") in PENDING:
                    self.notes.append(f"{doc}:{n}: {p} is not in the tree yet ({PENDING[p.rstrip('/')]})")
                else:
                    self.problem(doc, n, f"names '{p}', which does not exist")
        for m in HEADER_RE.finditer(text):
            p = "include/dml/" + m.group(1)
            if not path_exists(repo, p):
                self.problem(doc, n, f"names header '{m.group(0)}', but {p} does not exist")
        for m in LEARN_RE.finditer(text):
            num, name = m.group(1), m.group(2)
            stem = repo.learn.get(num)
            if stem is None or not (f"{num}_{name}" == stem or f"{num}_{name}".startswith(stem + "_")):
                self.problem(doc, n, f"names learn program '{num}_{name}', which examples/learn does not hold" +
                             (f" (its {num} is {stem})" if stem else ""))
        for m in LEARN_NUMBER_RE.finditer(text):
            if m.group(1) not in repo.learn:
                self.problem(doc, n, f"names learn program {m.group(1)}, which examples/learn does not hold")
        if re.search(r"learn", text, re.I):
            for m in COUNT_RE.finditer(text):
                word = m.group(1).lower()
                count = int(word) if word.isdigit() else NUMBER_WORDS[word]
                if count != self.learn_count:
                    self.problem(doc, n, f"says '{m.group(0)}', but examples/learn holds {self.learn_count} programs")

    def check_links(self, doc, n, text):
        base = os.path.dirname(doc)
        for m in LINK_RE.finditer(text):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            rel = os.path.normpath(os.path.join(base, file)) if file else doc
            if file and not self.repo.exists(rel):
                self.problem(doc, n, f"links to '{target}', but {rel} does not exist")
                continue
            if anchor and anchor not in anchors(os.path.join(self.repo.root, rel)):
                self.problem(doc, n, f"links to '{target}', but {rel} has no heading '#{anchor}'")

    # ---- flags ----
    def words(self, line):
        try:
            return shlex.split(line, comments=True)
        except ValueError:
            return line.split()

    def check_command(self, doc, n, words, state=None):
        """Flags given to dml's programs in one command line. Returns the program the line ends in (for
        continuation lines). `state`: the program a previous line left running."""
        repo = self.repo
        current = state  # a program name, "launch" (the next program word is the one run), "foreign", or None
        position = state is None  # at a word that starts a command
        for w in words:
            if w in (";", "&&", "||", "|", "&") or w.endswith(";") and not w.startswith("-"):
                current, position = None, True
                continue
            if position:
                position = False
                if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w) or w in LAUNCHERS:
                    current, position = "launch", True
                    continue
                prog = repo.program_of(w)
                current = prog if prog else "foreign"
                continue
            if current == "launch":
                prog = repo.program_of(w)
                if prog:
                    current = prog
                continue
            if current in (None, "foreign"):
                continue
            prog = repo.program_of(w)
            if prog and current == "dml-run":
                current = prog  # dml-run runs the program after its own flags
                continue
            flag = w.strip("[]()`'\",").split("=", 1)[0]
            if FLAG_RE.match(flag) and flag not in repo.programs[current]:
                self.problem(doc, n, f"gives {flag} to {current}, which does not declare it")
        return current if current not in ("launch",) else None

    def programs_named(self, text):
        """dml programs and foreign commands a paragraph names (in inline code)."""
        progs, foreign = set(), False
        for span in CODE_SPAN_RE.findall(text):
            for w in span.split():
                p = self.repo.program_of(w)
                if p:
                    progs.add(p)
                elif is_foreign(w):
                    foreign = True
            if re.match(r"^\s*(?:scripts/|\S+\.(?:py|sh)\b)", span) and not self.repo.program_of(span.split()[0]):
                foreign = True
        return progs, foreign

    def check_paragraph(self, doc, lines):
        """Inline code of a paragraph: command lines, and lone --flags attributed to the programs it names."""
        text = "\n".join(t for _, t in lines)
        progs, foreign = self.programs_named(text)
        for m in CODE_SPAN_RE.finditer(text):  # a span may run over a line's end
            n, span = lines[0][0] + text.count("\n", 0, m.start()), m.group(1).replace("\n", " ")
            ws = self.words(span) if "'" not in span else span.split()
            if not ws:
                continue
            if not ws[0].startswith("--"):
                self.check_command(doc, n, ws)
                continue
            for w in ws:
                flag = w.strip("[]()`'\",").split("=", 1)[0]
                if not FLAG_RE.match(flag) or flag == "--help":
                    continue
                if progs:
                    if any(flag in self.repo.programs[p] for p in progs) or foreign:
                        continue
                    self.problem(doc, n, f"names {flag} beside {', '.join(sorted(progs))}, "
                                         f"which do{'es' if len(progs) == 1 else ''} not declare it")
                elif not foreign and flag not in FOREIGN_FLAGS and not self.repo.flag_anywhere(flag):
                    self.problem(doc, n, f"names {flag}, which no program of the repository declares")

    def check_doc(self, doc):
        path = os.path.join(self.repo.root, doc)
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        fence = False
        para = []
        carried = None   # the program a code line left running (for its continuation lines)
        pending = ""     # a code line ending in '\'
        pending_n = 0

        def flush():
            if para:
                self.check_paragraph(doc, para)
                para.clear()

        for n, line in enumerate(lines, 1):
            self.check_names(doc, n, line)
            self.check_links(doc, n, line)
            if line.lstrip().startswith("```"):
                flush()
                fence = not fence
                carried, pending = None, ""
                continue
            if fence:
                if pending:
                    line, n0 = pending + " " + line.strip(), pending_n
                else:
                    n0 = n
                if line.rstrip().endswith("\\"):
                    pending, pending_n = line.rstrip()[:-1], n0
                    continue
                pending = ""
                body = line.strip()
                if body.startswith("$ "):
                    body = body[2:]
                if not body or body.startswith("#"):
                    carried = None
                    continue
                ws = self.words(body)
                first = ws[0].lstrip("[") if ws else ""
                if carried and line[:1].isspace() and first.startswith("--"):
                    self.check_command(doc, n0, ws, state=carried)  # a usage text's continuation line
                    continue
                carried = self.check_command(doc, n0, ws)
                if carried in ("foreign",):
                    carried = None
                continue
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                flush()
                continue
            if stripped.startswith("|") or re.match(r"^([-*+]|\d+\.)\s", stripped):
                flush()  # a table row or a list item is a paragraph of its own
            para.append((n, line))
            if stripped.startswith("|"):
                flush()
        flush()

    def run(self, docs=DOCS):
        for d in docs:
            if os.path.exists(os.path.join(self.repo.root, d)):
                self.check_doc(d)
            else:
                self.problem(d, 0, "is missing")
        return self.problems


def check(root, docs=DOCS):
    c = Checker(Repo(root))
    return c.run(docs), c.notes


# ---- self-test ----
def write(root, rel, text):
    p = os.path.join(root, rel)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "w", encoding="utf-8") as fh:
        fh.write(text)


def self_test():
    with tempfile.TemporaryDirectory() as root:
        write(root, "include/dml/train/engine.hpp", "")
        write(root, "examples/learn/01_one_rank.cpp", "")
        write(root, "examples/learn/02_ddp.cpp", "")
        write(root, "examples/gpt/train_gpt.hpp", 'f.add("--layers", o.layers, "N", "layers");\n'
                                                 'f.add_switch("--tie", o.tie, "tie");\n')
        write(root, "tools/dml-plan.cpp", 'f.add("--top", top, "N", "rows");\n')
        write(root, "tools/dml-run.cpp", 'f.add("--nproc", n, "N", "ranks");\n')
        write(root, "tests/ft/chaos.py", 'ap.add_argument("--runs")\nap.add_argument("--program")\n')
        write(root, "benchmarks/README.md", "# b\n\n## plan_accuracy\n")
        good = """# fake
`include/dml/train/engine.hpp` and `train/engine.hpp`; see [the figures](benchmarks/README.md#plan_accuracy).

```sh
build/cpu-release/examples/gpt/gpt --layers 2 --tie
dml-run --nproc 2 build/gpt --layers 2
python3 tests/ft/chaos.py --program build/gpt --runs 3
```

Learn dml in 2 programs: `01_one_rank` and `learn_02_ddp`. `--layers N` sets the depth of `gpt`.
"""
        bad = """# fake
`include/dml/train/missing.hpp`, `train/gone.hpp` and [a link](benchmarks/README.md#nowhere).

```sh
build/cpu-release/examples/gpt/gpt --layrs 2
dml-run --nproc 2 --nprocs 3 build/gpt --layers 2
```

The three learn programs: `03_custom`. `--top-k` picks layouts in `dml-plan`.

Give `--no-such-flag` anywhere.
"""
        expected = ["include/dml/train/missing.hpp", "train/gone.hpp", "#nowhere", "--layrs to gpt",
                    "--nprocs to dml-run", "'three learn programs'", "'03_custom'", "--top-k beside dml-plan",
                    "--no-such-flag, which no program"]
        failures = []
        for doc, text in (("README.md", good), ("DESIGN.md", bad)):
            write(root, doc, text)
        problems, _ = check(root, ["README.md"])
        if problems:
            failures.append("the good doc failed: " + "; ".join(problems))
        problems, _ = check(root, ["DESIGN.md"])
        for e in expected:
            if not any(e in p for p in problems):
                failures.append(f"the bad doc's '{e}' was not reported; reported: " + "; ".join(problems))
        if len(problems) != len(expected):
            failures.append(f"expected {len(expected)} problems, found {len(problems)}: " + "; ".join(problems))
    if failures:
        print("check_docs self-test: FAILED\n  " + "\n  ".join(failures))
        return 1
    print(f"check_docs self-test: passed ({len(expected)} planted mistakes found, the good doc clean)")
    return 0


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) != 2 or argv[1].startswith("-"):
        print("usage: check_docs.py REPO_ROOT | --self-test", file=sys.stderr)
        return 2
    problems, notes = check(argv[1])
    for note in notes:
        print("note: " + note)
    for p in problems:
        print(p)
    if problems:
        print(f"check_docs: {len(problems)} name(s) in the docs do not exist")
        return 1
    print(f"check_docs: every path, link, learn program and flag named in {', '.join(DOCS)} exists")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
