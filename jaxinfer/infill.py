"""Fill-in-the-middle: code completion between a prefix and a suffix, as editors ask for it
(llama.vscode's /infill, an OpenAI completion's `suffix`, ollama's generate with `suffix`).

A code model trained for it has three special tokens, found in its vocabulary by the names the
families give them (llama.cpp's table: Qwen2.5-Coder's `<|fim_prefix|>`, StarCoder's `<fim_prefix>`,
CodeLlama's `▁<PRE>`, DeepSeek-Coder's `<｜fim▁begin｜>`, ...; a GGUF file's vocabulary holds them by
the same names). The prompt is llama.cpp's, prefix first (PSM): BOS where the
tokenizer adds one; then, for other files given as context, Qwen2.5-Coder's repository form where
the model has its tokens (`<|repo_name|>`, a `<|file_sep|>` before each file's name and text), else
each file after a "--- snippet ---" line; then `PRE prefix SUF suffix MID`, and the model writes the
middle. Where it all does not fit the room the context leaves, the other files go first (their
earliest tokens), then the prefix's beginning and the suffix's end, 3:1 as llama.cpp shares them.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxinfer.errors import JaxinferError

# Each role's token in the families' vocabularies
NAMES = {
    "prefix": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "▁<PRE>",
        "<PRE>",
        "<|code_prefix|>",
    ),
    "suffix": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "▁<SUF>",
        "<SUF>",
        "<|code_suffix|>",
    ),
    "middle": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "▁<MID>", "<MID>", "<|code_middle|>"),
    "repo": ("<|repo_name|>", "<repo_name>", "<reponame>"),
    "file": ("<|file_sep|>", "<file_sep>", "<filename>"),
}
SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator of other files where the model has no file token


@dataclass(frozen=True)
class Fim:
    """A model's fill-in-the-middle tokens (`repo`, `file`: None where it has none)."""

    prefix: int
    suffix: int
    middle: int
    repo: int | None = None
    file: int | None = None

    @classmethod
    def of(cls, tokenizer) -> Fim:
        """The tokenizer's, by name; refused where it has none."""
        ids = {
            role: next((i for name in names if (i := tokenizer.token_id(name)) is not None), None)
            for role, names in NAMES.items()
        }
        if None in (ids["prefix"], ids["suffix"], ids["middle"]):
            raise JaxinferError(
                "this model has no fill-in-the-middle tokens (a prefix, a suffix and a middle one): it was not "
                "trained to fill in code between a prefix and a suffix",
                "suffix",
            )
        return cls(**ids)


def prompt_ids(tokenizer, prefix: str, suffix: str, files: list[dict] = (), room: int | None = None) -> list[int]:
    """The ids of a fill-in-the-middle prompt (the module's form), at most `room` of them."""
    fim = Fim.of(tokenizer)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    context: list[int] = []
    if files and fim.repo is not None:
        context += [fim.repo, *encode("myproject\n")]
    for f in files:  # each file's name and text one string, as the model read them in training
        context += [fim.file, *encode(f"{f['filename']}\n{f['text']}")] if fim.file is not None else []
        context += encode(SNIPPET + f["text"]) if fim.file is None else []
    if files and fim.file is not None:
        context += [fim.file, *encode("filename\n")]
    start = [tokenizer.bos_id] if tokenizer.adds_bos and tokenizer.bos_id is not None else []
    before, after = encode(prefix), encode(suffix)
    if room is not None:
        fixed = len(start) + 3
        context = context[max(0, len(context) - max(0, room - fixed - len(before) - len(after))) :]
        over = fixed + len(context) + len(before) + len(after) - room
        if over > 0:  # the prefix's beginning and the suffix's end, 3:1
            cut_after = min(len(after), max(over // 4, over - len(before)))
            before, after = before[min(len(before), over - cut_after) :], after[: len(after) - cut_after]
    return start + context + [fim.prefix, *before, fim.suffix, *after, fim.middle]


def check_files(value) -> list[dict]:
    """llama-server's `input_extra`: [{"filename", "text"}], the other files an edit sees."""
    if not isinstance(value, list) or not all(
        isinstance(f, dict) and isinstance(f.get("text"), str) and isinstance(f.get("filename", ""), str) for f in value
    ):
        raise JaxinferError('"input_extra" must be a list of {"filename": NAME, "text": TEXT}', "input_extra")
    return [{"filename": f.get("filename") or "tmp", "text": f["text"]} for f in value]
