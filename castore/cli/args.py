"""The ``castore`` command's arguments: the parser, each command's help and examples.

What each command does is in :mod:`castore.cli`; this module only says how it is
called. Every bad argument is one line naming the option, exit status 2.
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any, NoReturn

import castore
from castore import gc
from castore.cli.optionvalues import at_least_one, count, duration, percent, seconds, size

EXIT_USAGE = 2

# castore show: a list's run of at least this many plain values (not tensors, dicts
# or lists) is one row; an optimizer's parameter list would otherwise fill the screen.
COLLAPSE_AT = 4


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, not argparse's usage block plus the message.
        self.exit(EXIT_USAGE, f"castore: {message} (see {self.prog} --help)\n")


STORE_HELP = (
    "the store's directory (the path given to castore.open), a shared store's directory "
    "(created with castore.open(DIR, shared=True)), or s3://BUCKET/PREFIX for a store on "
    "S3-protocol object storage, reached through boto3's chain (AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION or a profile)"
)
TARGET_HELP = """\
RUN[@GEN] names a generation of run RUN:
  RUN           the newest generation (RUN@latest is the same)
  RUN@7         generation id 7 (the id column of castore log)
  RUN@release   the generation tag "release" pins (castore tag; log lists tags)
  RUN@3fa2c1    the generation whose root digest starts with these hex digits
                (6 to 64 of them; log shows the first 12)
An all-digit GEN is always an id; a tag name wins over a root prefix it spells;
RUN@ with nothing after the @ is an error, not the newest."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions' and examples' lines; adds each option's default, if it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or not action.option_strings:
            return text
        if action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        if action.nargs == argparse.PARSER:
            # argparse measures the command names at the list's indent but prints them one
            # indent deeper: the longest (verify-export) would wrap onto a line of its own.
            self._action_max_length += self._indent_increment


def _command(
    commands: Any, name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        help=summary,
        description=description,
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples.splitlines()),
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("store", metavar="STORE", help=STORE_HELP)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="castore",
        description="Inspect, check, tag, collect and compact a castore store; branch, amend,\n"
        "copy, diff, export and import its generations.\n\n"
        + textwrap.fill(f"STORE is {STORE_HELP}.", 79)
        + "\n"
        "Errors print one line and exit non-zero (CASTORE_DEBUG=1 adds the traceback).\n"
        "castore COMMAND --help describes a command, with examples.",
        epilog="examples:\n"
        "  castore log ./ckpt\n"
        "  castore show ./ckpt exp1@3\n"
        "  castore verify ./ckpt --deep\n"
        "  castore log s3://bucket/ckpt\n"
        "  castore gc ./ckpt --keep 2 --dry-run",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"castore {castore.__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, parser_class=_Parser, metavar="COMMAND"
    )
    _add_inspection(commands)
    _add_tags(commands)
    _add_branch(commands)
    _add_collection(commands)
    _add_maintenance(commands)
    _add_copy(commands)
    _add_diff(commands)
    _add_export(commands)
    _add_verify_export(commands)
    _add_import(commands)
    return parser


def _add_inspection(commands: Any) -> None:
    log = _command(
        commands,
        "log",
        "table of generations with sizes and dedup",
        "List every generation of every run (or of one run), oldest first: id, step,\n"
        "time, logical size, chunk bytes new in that save, bytes it wrote (new chunks\n"
        "and manifests), dedup %, how long the save held training (for an async save:\n"
        "its snapshot), root digest prefix, tags.\n\n"
        "--graph draws instead a line per generation, newest first, with its parents\n"
        "across runs: * is a generation, | leads down to its parent (the run's previous\n"
        "generation, or for a branch or an amend the generation it was made from),\n"
        "|-\\ branches off to another parent (an amend's graft donor) and |-/ joins\n"
        "lines at their common parent. Each line says how the generation was made\n"
        "(save, branch of base@3, amend of ... with its changes, import safetensors\n"
        "FILE, copied here: ...) and names any parent not drawn: collected, not in this\n"
        "store, or older than -n shows. With --run, the run and every generation it\n"
        "descends from, in any run.",
        "castore log ./ckpt\ncastore log ./ckpt --run exp1 -n 10\n"
        "castore log ./ckpt --graph\ncastore log ./ckpt --graph --run finetune-a",
    )
    log.add_argument(
        "--run", help="list only this run (no run column); --graph: and what it descends from"
    )
    log.add_argument(
        "--graph",
        action="store_true",
        help="a text graph of generations and their parents across runs (see above)",
    )
    log.add_argument(
        "-n",
        "--max-count",
        type=at_least_one("generations listed per run"),
        metavar="N",
        help="only the newest N generations of each run (reads only those; default: all)",
    )
    show = _command(
        commands,
        "show",
        "tensors and values of one generation",
        "Show one generation: root, parent, rank count, versions, data order, every\n"
        "tensor (dtype, shape, size, boxes, chunks), and the non-tensor values.\n"
        f"A run of {COLLAPSE_AT} or more plain values in a list (an optimizer's parameter\n"
        "names, say) is one row: count, first and last; --all lists every value.\n"
        "A last line totals tensors, bytes and values.\n\n" + TARGET_HELP,
        "castore show ./ckpt exp1          # the newest generation of exp1\n"
        "castore show ./ckpt exp1@3 --all  # generation 3, every value on its own row",
    )
    show.add_argument("target", metavar="RUN[@GEN]", help="the generation (see above)")
    show.add_argument(
        "--all",
        action="store_true",
        help="list every value and a DCP save's whole metadata; collapse nothing",
    )
    verify = _command(
        commands,
        "verify",
        "check objects and chunks; non-zero on problems",
        "Check the store: every ref, root and shard manifest is read and verified\n"
        "against its digest, every tensor's boxes cover it, every chunk is present\n"
        "and its pack long enough to hold it (a truncated pack is named); the chunks'\n"
        "bytes are not read. --deep also re-hashes every chunk and checks the chunk\n"
        "index; --sample P re-hashes each chunk with chance P percent (a cheap\n"
        "periodic check). Each problem prints as a PROBLEM line; exit 0 when there\n"
        "is none, 1 otherwise.\n\n"
        "Without RUN[@GEN], every run is checked; RUN alone checks every generation of\n"
        "the run, RUN@GEN only that one. An unknown run or generation is an error.\n\n"
        + TARGET_HELP,
        "castore verify ./ckpt --deep\ncastore verify ./ckpt exp1@latest --sample 5",
    )
    verify.add_argument(
        "target", nargs="?", metavar="RUN[@GEN]", help="what to check (default: everything)"
    )
    how = verify.add_mutually_exclusive_group()
    how.add_argument("--deep", action="store_true", help="re-hash every chunk")
    how.add_argument(
        "--sample",
        type=percent,
        metavar="P",
        help="re-hash each chunk with chance P%%, 0 < P <= 100 (a percent, not a fraction)",
    )


def _add_branch(commands: Any) -> None:
    branch = _command(
        commands,
        "branch",
        "start a new run from a generation of any run (no chunk written)",
        "Start NEWRUN with RUN@GEN as its generation 1: the same tensors and values,\n"
        "sharing every chunk (only a manifest per rank and a root are written). Saves\n"
        "to NEWRUN then continue from it; castore log shows where it came from, and gc\n"
        "keeps the shared chunks while any run names them. NEWRUN must not exist.\n\n"
        + TARGET_HELP,
        "castore branch ./ckpt base@12 finetune-a\ncastore branch ./ckpt base finetune-b",
    )
    branch.add_argument("target", metavar="RUN[@GEN]", help="the generation to start from")
    branch.add_argument("new_run", metavar="NEWRUN", help="the new run's name")
    amend = _command(
        commands,
        "amend",
        "publish a generation with subtrees dropped, renamed, grafted or replaced",
        "Publish RUN@GEN changed, as the next generation of RUN, or of NEWRUN with --to\n"
        "(a new run starts at 1). The changes apply in this order:\n"
        "  --drop      leave out every entry whose key path matches PATTERN (shell-style\n"
        "              over key paths, which castore show lists; 'optim/**' drops optim\n"
        "              itself too): the optimizer state left out of a release;\n"
        "  --rename    change the start of keys within one dict (model.= strips 'model.',\n"
        "              model/enc.=model/encoder. works one level down), never a key's level;\n"
        "  --graft     put the entries of another generation whose key path starts with OLD\n"
        "              in place of those here that start with NEW (a teacher's encoder in a\n"
        "              student); a tensor both have must keep its dtype and shape;\n"
        "  --replace   a tensor's new value from a .npy file or one tensor of a\n"
        "              .safetensors file (FILE.safetensors:NAME): only its new chunks are\n"
        "              written, on the boxes it was saved in;\n"
        "  --set/--unset  user metadata (VALUE is JSON where it parses, else text).\n"
        "Every other tensor shares its chunks with RUN@GEN: a manifest per rank and a\n"
        "root are written. A pattern, prefix or key that matches nothing, two keys\n"
        "renamed alike, a graft whose tensors differ, or a result without a tensor is\n"
        "refused, and nothing is published.\n\n" + TARGET_HELP,
        "castore amend ./ckpt exp1@12 --drop 'optim/**' --to release\n"
        "castore amend ./ckpt exp1 --drop 'model/*.bias' --drop 'scaler'\n"
        "castore amend ./ckpt hf@3 --rename model.= --to plain\n"
        "castore amend ./ckpt student --graft 'teacher@7:model/encoder.=model/encoder.'\n"
        "castore amend ./ckpt exp1 --replace model/lm_head.weight=head.npy --set note=retied",
    )
    amend.add_argument("target", metavar="RUN[@GEN]", help="the generation to amend")
    amend.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="PATTERN",
        help="a key path pattern to leave out (repeatable)",
    )
    amend.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="change the start of the keys that begin with OLD (a key path prefix ending "
        "inside one key) to NEW (repeatable): model.= strips 'model.'",
    )
    amend.add_argument(
        "--graft",
        action="append",
        default=[],
        metavar="RUN[@GEN]:OLD=NEW",
        help="put RUN@GEN's entries that start with OLD where this one's start with NEW "
        "(repeatable)",
    )
    amend.add_argument(
        "--replace",
        action="append",
        default=[],
        metavar="KEY_PATH=FILE",
        help="a tensor's new value: FILE.npy or FILE.safetensors[:NAME] (repeatable)",
    )
    amend.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="set a metadata key"
    )
    amend.add_argument(
        "--unset", action="append", default=[], metavar="KEY", help="remove a metadata key"
    )
    amend.add_argument("--to", metavar="NEWRUN", default=None, help="publish to this run")


def _add_tags(commands: Any) -> None:
    tag = _command(
        commands,
        "tag",
        "pin a generation under a name (retention keeps it)",
        "Pin a generation under NAME: castore gc keeps it, whatever the policy, until\n"
        "it is untagged. A NAME the run already has moves to this generation, and the\n"
        "generation it named is no longer pinned by it (the output says which). NAME\n"
        "cannot be all digits or 'latest': RUN@NAME would mean an id, or the newest.\n\n"
        + TARGET_HELP,
        "castore tag ./ckpt exp1@2 release\ncastore tag ./ckpt exp1 before-lr-change",
    )
    tag.add_argument("target", metavar="RUN[@GEN]", help="the generation to pin (see above)")
    tag.add_argument(
        "name",
        metavar="NAME",
        help="the tag's name, unique within the run: letters, digits, . _ - (not all digits)",
    )
    untag = _command(
        commands,
        "untag",
        "remove a tag",
        "Remove tag NAME of run RUN; the generation it pinned is again subject to\n"
        "retention (the next castore gc may drop it).",
        "castore untag ./ckpt exp1 release",
    )
    untag.add_argument("run", metavar="RUN", help="the run the tag belongs to")
    untag.add_argument("name", metavar="NAME", help="the tag to remove")


def _add_collection(commands: Any) -> None:
    collect = _command(
        commands,
        "gc",
        "apply the retention policy and free garbage",
        "Apply the retention policy to each run, then delete every chunk and object no\n"
        "kept generation references. A generation is kept if any rule keeps it: the\n"
        "newest --keep, every tagged one, and those --every-steps and --every name.\n\n"
        "It prints the plan: each generation, keep or drop, and the rules that keep\n"
        "it. When stdin is a terminal and generations would be dropped, it then asks\n"
        "before deleting (--yes skips the question). When stdin is not a terminal\n"
        "(scripts, cron, CI, a notebook's !castore gc) it does not ask: it deletes only\n"
        "when the policy is given (--keep, --every-steps, --every) or --yes is passed,\n"
        "and otherwise exits 1 having deleted nothing.",
        "castore gc ./ckpt --keep 2 --dry-run     # show the plan, delete nothing\n"
        "castore gc ./ckpt --keep 5 --every 1d --yes",
    )
    collect.add_argument("--run", help="apply the policy to this run only (others keep all)")
    collect.add_argument(
        "--keep",
        type=at_least_one("how many of the newest generations of each run to keep"),
        metavar="K",
        help="keep the newest K generations of each run, K >= 1 "
        f"(default: {gc.RetentionPolicy.keep_last})",
    )
    collect.add_argument(
        "--every-steps",
        type=at_least_one("the step interval whose first generation is kept"),
        metavar="N",
        help="also keep the first generation of every N training steps, N >= 1",
    )
    collect.add_argument(
        "--every",
        type=duration,
        metavar="DURATION",
        help="also keep the newest generation of every interval (90s, 30m, 6h, 1d, 2w)",
    )
    collect.add_argument(
        "--dry-run", action="store_true", help="show what each rule keeps and what would be freed"
    )
    collect.add_argument(
        "-y", "--yes", action="store_true", help="delete without asking, even on a terminal"
    )
    collect.add_argument(
        "--wait",
        type=seconds,
        default=30,
        metavar="SECONDS",
        help="how long to wait for running saves before giving up",
    )
    du = _command(
        commands,
        "du",
        "logical and physical bytes, per generation; compression per run and dtype",
        "Storage accounting: per generation its logical bytes, the chunk bytes it\n"
        "references, and the bytes only it references (what dropping it frees); per run\n"
        "and per dtype, the raw bytes of the chunks they reference against those bytes as\n"
        "stored (less where a codec compressed them); then the store's logical, stored\n"
        "(deduplicated), physical and on-disk totals, and the codec new saves use.",
        "castore du ./ckpt\ncastore du ./ckpt --run exp1",
    )
    du.add_argument("--run", help="only this run's generations")
    tiers = _command(
        commands,
        "tiers",
        "which generations the fast and the durable tier hold",
        "For a tiered store (castore.open_tiered): per generation, whether the fast tier\n"
        "STORE (with --node, the fast tiers of several nodes together) holds every shard\n"
        "(held), some of them (K/N shards: the rest are on other nodes or in the durable\n"
        "tier), lists it with its chunks elsewhere (elsewhere) or not at all (-), whether\n"
        "DURABLE has it, and whether a promotion to DURABLE is pending. A fast tier whose\n"
        "directory is gone is listed as a lost node. Then, per run, the generation a\n"
        "restore would select now (its id, step, sources, and how far behind the newest),\n"
        "and how old its newest generation held whole in each tier is (the recovery point\n"
        "if that tier were all that is left). Reads only.",
        "castore tiers /dev/shm/ckpt s3://bucket/ckpt\ncastore tiers ./fast ./durable --run exp1\n"
        "castore tiers ./node0/fast ./durable --node ./node1/fast",
    )
    tiers.add_argument("durable", metavar="DURABLE", help="the durable tier's store")
    tiers.add_argument("--run", help="only this run's generations")
    tiers.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="FAST",
        help="another node's fast tier, counted with STORE's (repeatable)",
    )


def _add_maintenance(commands: Any) -> None:
    repair = _command(
        commands,
        "repair",
        "remove corrupt chunks and objects; list what stays damaged",
        "Re-hash every chunk and object, remove those whose bytes do not match their\n"
        "name, restore a lost ref from its reflog, and list the generations that stay\n"
        "damaged. Exit 0 when every generation is whole, 1 otherwise.",
        "castore repair ./ckpt --dry-run\ncastore repair ./ckpt --rebuild-index",
    )
    repair.add_argument("--dry-run", action="store_true", help="report, change nothing")
    repair.add_argument(
        "--wait",
        type=seconds,
        default=30,
        metavar="SECONDS",
        help="how long to wait for running saves before giving up",
    )
    repair.add_argument(
        "--rebuild-index",
        action="store_true",
        help="first write a fresh LMDB file: the chunk index rebuilt from the packs, every "
        "readable object copied (offline: no other process may have the store open)",
    )
    _command(
        commands,
        "compact",
        "rewrite packs and the LMDB file without dead space (offline)",
        "Rewrite every pack with dead space and the LMDB file without its free pages.\n"
        "Offline: refused while any process has the store open.",
        "castore compact ./ckpt",
    )


def _add_copy(commands: Any) -> None:
    copy: argparse.ArgumentParser = commands.add_parser(
        "copy",
        help="copy generations to another store (only the chunks it lacks)",
        description="Copy generations from store SRC to store DST, oldest first: only the\n"
        "chunks DST lacks are read, each re-hashed against its name before it is\n"
        "written, and each generation is published at DST through DST's own commit,\n"
        "with the same root digest. By default the latest generation of each run;\n"
        "GEN is an id, a tag name or a root digest prefix, as in RUN@GEN. A DST that\n"
        "does not exist is created. DST keeps its history consistent: a generation\n"
        "whose parent is not copied logs that parent as not held there (collected).\n"
        "Tags are not copied. An interrupted copy resumes: run it again.\n"
        "Exit 1, with nothing of that generation published, when a chunk or object\n"
        "of SRC is damaged or DST already has a newer generation of the run.",
        epilog="examples:\n"
        + "\n".join(
            f"  {line}"
            for line in (
                "castore copy ./ckpt /mnt/backup/ckpt             # the latest of each run",
                "castore copy ./ckpt /mnt/backup/ckpt --run exp1 --all",
                "castore copy ./ckpt /mnt/backup/ckpt --run exp1 --generation release",
                "castore copy ./ckpt s3://backups/ckpt            # a second failure domain",
                "castore copy ./ckpt ./ckpt-small --codec auto     # compressed (remembered)",
            )
        ),
        formatter_class=_HelpFormatter,
    )
    copy.add_argument("store", metavar="SRC", help=f"the store to copy from: {STORE_HELP}")
    copy.add_argument(
        "dst",
        metavar="DST",
        help="the store to copy into, named as SRC is; a missing directory becomes a "
        "single-node store and a missing s3:// store is created (create a shared one first)",
    )
    copy.add_argument("--run", help="copy this run only (default: every run with a ref)")
    which = copy.add_mutually_exclusive_group()
    which.add_argument(
        "--generation",
        metavar="GEN",
        help="copy this generation of --run: an id, a tag or a root prefix (default: the latest)",
    )
    which.add_argument(
        "--all",
        action="store_true",
        dest="all_generations",
        help="copy every stored generation of the run(s), oldest first",
    )
    copy.add_argument(
        "--codec",
        choices=["none", "auto", "zstd", "bytegroup"],
        help="how DST stores the chunks: compressed (auto, zstd, bytegroup) or raw (none); "
        "default: DST's own codec, or for a new DST its default (none for a local store, "
        "auto on S3 or a shared directory)",
    )


def _add_diff(commands: Any) -> None:
    diff = _command(
        commands,
        "diff",
        "what changed between two generations",
        "Compare generation A with generation B (by default A's parent; a first\n"
        "generation is compared with nothing, so everything in it is added). B may be\n"
        "a generation of another run: a fine-tune against its base. Tensors are\n"
        "compared by their manifests (boxes and chunk digests, not bytes):\n"
        "added, removed, changed (dtype or shape changes, and the bytes of chunks in\n"
        "A that B lacks: the new bytes), unchanged. A tensor whose boxes changed but\n"
        "whose dtype and shape did not is resharded: only then are both sides read\n"
        "and compared (64 MiB a side at most; past that, bytes not compared).\n"
        "Then the non-tensor values, the data-order record and the step\n"
        "that differ, old -> new; a last line sums it up (--stat: only that line).\n\n"
        + TARGET_HELP,
        "castore diff ./ckpt exp1@3            # generation 3 against its parent\n"
        "castore diff ./ckpt exp1@5 exp1@2 --stat\n"
        "castore diff ./ckpt exp1 --each 10      # a line per generation: the newest 10\n"
        "castore diff ./ckpt ft@3 base@10      # a fine-tune against its base",
    )
    diff.add_argument("a", metavar="RUN@A", help="the generation to describe (see above)")
    diff.add_argument(
        "b",
        nargs="?",
        metavar="RUN@B",
        help="the generation to compare it with (default: A's parent, or what a branch or "
        "amend was made from; RUN alone: its latest)",
    )
    diff.add_argument("--stat", action="store_true", help="print only the one-line summary")
    diff.add_argument(
        "--each",
        nargs="?",
        const=0,
        type=count,
        metavar="N",
        help="a --stat line for each stored generation of A's run up to A, oldest first, "
        "each against the one stored before it (N: only the newest N)",
    )


def _add_export(commands: Any) -> None:
    export = _command(
        commands,
        "export",
        "write a generation's tensors as safetensors files",
        "Export the tensors of one generation to directory OUT in Hugging Face's layout: one\n"
        "model.safetensors when everything fits --max-shard-size, else\n"
        "model-00001-of-0000N.safetensors files and model.safetensors.index.json.\n"
        "Tensors are named by key path joined with '/' (model/layers.0.weight); plain\n"
        "values (steps, learning rates) are not exported. The export streams: no whole\n"
        "tensor is held in memory, only stripes of rows, each from the chunks it overlaps,\n"
        "every chunk verified. OUT must not exist or be empty; the files are written\n"
        "next to it and moved into place only when all are complete, so a failure (a\n"
        "damaged chunk, say: exit 1) leaves nothing. An OUT ending in .safetensors is\n"
        "one file instead, holding every selected tensor (it must not exist;\n"
        "--max-shard-size and --index-from need a directory). --format torch writes\n"
        "one torch.save file OUT instead (a pickle; see --format). --statement also\n"
        "writes castore-export.intoto.json beside the files: an in-toto statement in\n"
        "OpenSSF model-signing's form, naming each file's sha256 and the generation,\n"
        "for a signer and for castore verify-export.\n\n" + TARGET_HELP,
        "castore export ./ckpt exp1 ./hf-model\n"
        "castore export ./ckpt exp1 ./exp1.safetensors --prefix model/ --strip-prefix\n"
        "castore export ./ckpt exp1@7 ./hf --prefix model/ --strip-prefix --dtype bf16\n"
        "castore export ./ckpt exp1 ./hf --max-shard-size 2GB --rename model/=transformer.\n"
        "castore export ./ckpt exp1@release ./hf --prefix model/ --strip-prefix --statement\n"
        "castore export ./ckpt exp1 ./hf --prefix model/ --strip-prefix "
        "--index-from base/model.safetensors.index.json\n"
        "castore export ./ckpt exp1 ./model.pt --format torch --prefix model/ --strip-prefix",
    )
    export.add_argument("target", metavar="RUN[@GEN]", help="the generation (see above)")
    export.add_argument(
        "out",
        metavar="OUT",
        help="safetensors: the directory to create (must not exist or be empty), or, "
        "when it ends in .safetensors, the one file to create (must not exist); "
        "torch: the file to create (must not exist)",
    )
    export.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="safetensors (recommended): Hugging Face's format, streamed, and reading it "
        "runs no code. torch: one torch.save file of a dict name -> tensor, for tools that "
        "need it; it is a PICKLE (loading an untrusted one can run arbitrary code) and "
        "every selected tensor is held in memory while it is written",
    )
    export.add_argument(
        "--prefix",
        metavar="PREFIX",
        help="export only the tensors under the key path PREFIX, e.g. model (model/..., "
        "not model_ema/...)",
    )
    export.add_argument(
        "--strip-prefix", action="store_true", help="remove --prefix from the exported names"
    )
    export.add_argument(
        "--dtype",
        choices=("keep", "bf16", "fp16", "fp32"),
        default="keep",
        help="convert floating-point tensors to this type; other tensors keep theirs",
    )
    export.add_argument(
        "--max-shard-size",
        type=size,
        metavar="SIZE",
        help="safetensors: most tensor bytes per file: 5GB, 500MB, 2GiB or bytes; a "
        "larger tensor gets a file of its own (default: 5GB)",
    )
    export.add_argument(
        "--rename",
        action="append",
        metavar="FROM=TO",
        help="rename a name prefix, after --strip-prefix (repeatable; the first match wins)",
    )
    export.add_argument(
        "--index-from",
        metavar="INDEX",
        help="safetensors: follow an existing model.safetensors.index.json: its files and names "
        "(a tensor it does not list is an error); overrides --max-shard-size",
    )
    export.add_argument(
        "--statement",
        action="store_true",
        help="safetensors, OUT a directory: also write castore-export.intoto.json, the "
        "statement a signer signs and castore verify-export checks (each file's sha256 is "
        "taken as it is written)",
    )


def _add_verify_export(commands: Any) -> None:
    checked: argparse.ArgumentParser = commands.add_parser(
        "verify-export",
        help="prove an export bitwise the generation its statement names",
        description="Prove that the export in DIR is bitwise the generation its statement\n"
        "(castore-export.intoto.json, written by castore export --statement) names,\n"
        "file by file, reading each file once: its sha256 must be the statement's, its\n"
        "safetensors header the one the export of that generation writes, and each\n"
        "tensor's bytes the generation's (each saved chunk's place in the file hashed\n"
        "with blake3 against the chunk's name; a tensor exported with --dtype compared\n"
        "with its saved bytes converted). STORE must hold the generation's root (the\n"
        "store exported from, or a copy). DIR must hold the statement's files and no\n"
        "other (a model.sig beside them aside). Prints one line per file and a verdict;\n"
        "a difference is one line naming the file and the tensor, exit 1. The\n"
        "signature, if any, is checked by the signer's tool (docs/INTEROP.md).",
        epilog="examples:\n"
        "  castore verify-export ./hf ./ckpt\n"
        "  castore verify-export ./release s3://bucket/ckpt",
        formatter_class=_HelpFormatter,
    )
    checked.add_argument("dir", metavar="DIR", help="the export directory, with its statement")
    checked.add_argument("store", metavar="STORE", help=f"the store to check against: {STORE_HELP}")


def _add_import(commands: Any) -> None:
    imported: argparse.ArgumentParser = commands.add_parser(
        "import",
        help="import safetensors, torch.save or DCP checkpoints as generations",
        description="Import each SOURCE, in the order given, as the next generation of RUN\n"
        "in STORE, published through castore's normal commit: a series of old\n"
        "checkpoints deduplicates, each writing only the chunks the store lacks.\n"
        "A SOURCE is a .safetensors file, a directory with\n"
        "model.safetensors.index.json and its shards, a directory of *.safetensors\n"
        "files, a torch.distributed.checkpoint (DCP) directory, whose saved chunks\n"
        "stay boxes of as many writers, or a torch.save file. torch.save files and\n"
        "DCP's pickled values are read with torch.load(weights_only=True) only, and\n"
        "DCP's .metadata with only DCP's metadata types allowed: arbitrary pickled\n"
        "objects are refused, never unpickled.\n"
        "Prints one line per SOURCE with the bytes deduplication saved.\n"
        "A STORE that does not exist is created (as castore.open(STORE) does).\n"
        "Every SOURCE is checked first: a missing one, one of an unknown kind, or\n"
        "safetensors whose index or headers are malformed, imports nothing and\n"
        "creates no STORE (exit 1). A SOURCE refused while it is read stops the\n"
        "import there (exit 1); the SOURCEs before it stay imported.",
        epilog="examples:\n"
        + "\n".join(
            f"  {line}"
            for line in (
                "castore import ./ckpt llama ./Llama-3-8B/          # a sharded HF directory",
                "castore import ./ckpt exp1 model.safetensors --step 1000",
                "castore import ./ckpt exp1 old/step-*.pt           # a series, oldest first",
                "castore import ./ckpt exp1 ./dcp/step-2000/        # a DCP directory",
            )
        ),
        formatter_class=_HelpFormatter,
    )
    imported.add_argument("store", metavar="STORE", help=f"the store to import into: {STORE_HELP}")
    imported.add_argument("run", metavar="RUN", help="the run the generations are added to")
    imported.add_argument(
        "sources", metavar="SOURCE", nargs="+", help="checkpoints to import, oldest first"
    )
    imported.add_argument(
        "--step",
        type=int,
        help="the training step of the first SOURCE; each next one gets the next step "
        "(default: each generation's id)",
    )
