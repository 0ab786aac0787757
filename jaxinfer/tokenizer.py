"""Text ⇄ token ids for a model directory, and exact streaming detokenisation.

Two backends behind one small interface: `tokenizer.json` through the `tokenizers` library (what
transformers' fast tokenizers run), else `tokenizer.model` through sentencepiece. BOS/EOS follow
tokenizer_config.json as transformers reads it.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from jaxinfer.errors import JaxinferError


def _token_text(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read back: each of 256 printable characters → its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


def _piece_bytes(piece: str | None, kind: str) -> bytes:
    if piece is None:
        return b""
    if kind == "byte-level":
        table = _byte_decoder()
        return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)
    if kind == "piece":
        if (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)) is not None:
            return bytes([int(m[1], 16)])
        return piece.replace("▁", " ").encode()
    return piece.encode()


class Tokenizer:
    vocab_size: int  # one past the highest id: what decode can turn into text

    def __init__(self, model_dir: Path, config: dict | None = None):
        """`config`: tokenizer_config.json's settings where the directory has none of its own (a
        gemma-library checkpoint's, `gemma_library.TOKENIZER_CONFIG`)."""
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else (config or {})
        if (model_dir / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                hf = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
            except Exception as e:  # the library raises plain Exception for a bad file
                raise JaxinferError(f"{model_dir / 'tokenizer.json'}: cannot be read ({e})") from None
            self._setup(config, hf=hf)
        elif (model_dir / "tokenizer.model").is_file():
            import sentencepiece

            try:
                sp = sentencepiece.SentencePieceProcessor(model_file=str(model_dir / "tokenizer.model"))
            except (OSError, RuntimeError) as e:
                raise JaxinferError(f"{model_dir / 'tokenizer.model'}: cannot be read ({e})") from None
            self._setup(config, sp=sp, specials=[_token_text(t) for t in config.get("additional_special_tokens", [])])
        else:
            raise JaxinferError(f"{model_dir}: no tokenizer.json or tokenizer.model found")

    @classmethod
    def from_gguf(cls, meta: dict, where: str) -> Tokenizer:
        """The tokenizer a GGUF file's metadata describes (`jaxinfer.gguf_tokenizer`), as llama.cpp runs it."""
        from jaxinfer import gguf_tokenizer

        kind = gguf_tokenizer.check_model(meta, where)
        config = gguf_tokenizer.tokenizer_config(meta)
        tokenizer = cls.__new__(cls)
        if kind in ("gpt2", "gemma4"):
            from tokenizers import processors

            hf = gguf_tokenizer.bpe_tokenizer(meta, where)
            bos, eos = (
                [config[f"{e}_token"]] if config[f"add_{e}_token"] and f"{e}_token" in config else []
                for e in ("bos", "eos")
            )
            if bos or eos:  # the post-processor adds them, as tokenizer.json's do
                single = " ".join([*bos, "$A", *eos])
                hf.post_processor = processors.TemplateProcessing(
                    single=single, special_tokens=[(t, hf.token_to_id(t)) for t in (*bos, *eos)]
                )
            tokenizer._setup(config, hf=hf)
        else:
            import sentencepiece

            sp = sentencepiece.SentencePieceProcessor(model_proto=gguf_tokenizer.sentencepiece_model(meta, where))
            tokenizer._setup(config, sp=sp, specials=gguf_tokenizer.specials(meta))
        return tokenizer

    def _setup(self, config: dict, hf=None, sp=None, specials: list[str] = ()) -> None:
        """`specials`: tokens matched whole in the text besides the named ones (sentencepiece only;
        tokenizer.json's added tokens do it themselves)."""
        self.config, self._hf, self._sp, self._extra_specials = config, hf, sp, list(specials)
        if hf is not None:
            self.vocab_size = max(hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        else:
            self.vocab_size = sp.get_piece_size()
        self.bos_id = self.token_id(_token_text(self.config.get("bos_token")))
        self.eos_id = self.token_id(_token_text(self.config.get("eos_token")))
        if self._sp is not None:  # sentencepiece defaults, as transformers' LlamaTokenizer
            self.bos_id = (
                self.bos_id if self.bos_id is not None else (self._sp.bos_id() if self._sp.bos_id() >= 0 else None)
            )
            self.eos_id = (
                self.eos_id if self.eos_id is not None else (self._sp.eos_id() if self._sp.eos_id() >= 0 else None)
            )
        self.special_tokens = self._special_tokens()  # what chat templates see
        specials = sorted({t for t in (*self.special_tokens.values(), *specials) if t}, key=len, reverse=True)
        self._specials = re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        self._kept: dict[int, str] = {}  # special tokens decoding keeps as text (`keep`)

    def save(self, directory: Path) -> None:
        """Into a model directory as transformers keeps it: tokenizer.json or tokenizer.model, and
        tokenizer_config.json (with the tokens matched whole as `additional_special_tokens`)."""
        if self._hf is not None:
            self._hf.save(str(directory / "tokenizer.json"))
        else:
            (directory / "tokenizer.model").write_bytes(self._sp.serialized_model_proto())
        config = {**self.config, "additional_special_tokens": self._extra_specials}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @functools.cached_property
    def adds_bos(self) -> bool:
        """Whether encoding puts BOS before a text (as prompts are encoded)."""
        return self.bos_id is not None and self.encode("x")[:1] == [self.bos_id]

    @functools.cached_property
    def max_piece_chars(self) -> int:
        """The most characters of text one token spells (its longest piece's)."""
        return max((len(piece) for piece in self.pieces()), default=1)

    def pieces(self) -> dict[str, int]:
        """Every token's text (as the tokenizer names it) → its id: two tokenizers with the same
        pieces turn the same ids into the same text."""
        if self._hf is not None:
            return self._hf.get_vocab(with_added_tokens=True)
        return {self._sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` adds to a text, as llama.cpp's `token_to_piece` and OpenAI's
        `logprobs` give them: a byte-level BPE piece mapped back to its bytes, a sentencepiece one
        with "▁" as a space and <0xNN> as that byte (a token may hold part of a character); special
        and added tokens as their text; b"" for an id the tokenizer does not have."""
        return self._token_bytes[i] if 0 <= i < len(self._token_bytes) else b""

    @functools.cached_property
    def special_ids(self) -> list[int]:
        """The ids of special tokens (BOS, EOS, a chat template's markers): never text a constraint matches."""
        if self._hf is not None:
            return sorted(i for i, t in self._hf.get_added_tokens_decoder().items() if t.special)
        return [i for i in range(self.vocab_size) if self._sp.is_control(i) or self._sp.is_unknown(i)]

    @functools.cached_property
    def _token_bytes(self) -> list[bytes]:
        if self._hf is not None:
            added = {i: t.content for i, t in self._hf.get_added_tokens_decoder().items()}
            byte_level = '"ByteLevel"' in json.dumps(json.loads(self._hf.to_str()).get("decoder"))
            pieces = [added.get(i, self._hf.id_to_token(i)) for i in range(self.vocab_size)]
            kinds = ["added" if i in added else "byte-level" if byte_level else "piece" for i in range(self.vocab_size)]
        else:
            sp = self._sp
            pieces = [sp.id_to_piece(i) for i in range(self.vocab_size)]
            kinds = [
                "piece" if sp.is_byte(i) or not (sp.is_control(i) or sp.is_unknown(i)) else "added"
                for i in range(self.vocab_size)
            ]
        return [_piece_bytes(piece, kind) for piece, kind in zip(pieces, kinds)]

    def _special_tokens(self) -> dict[str, str | None]:
        """bos_token, eos_token, unk_token, pad_token as text."""
        found = {
            f"{name}_token": _token_text(self.config.get(f"{name}_token")) for name in ("bos", "eos", "unk", "pad")
        }
        if self._sp is not None:  # sentencepiece's own BOS/EOS when tokenizer_config.json names none
            for name, i in (("bos", self.bos_id), ("eos", self.eos_id)):
                if found[f"{name}_token"] is None and i is not None:
                    found[f"{name}_token"] = self._sp.id_to_piece(i)
        return found

    def token_id(self, text: str | None) -> int | None:
        if text is None:
            return None
        if self._hf is not None:
            return self._hf.token_to_id(text)
        i = self._sp.piece_to_id(text)
        return None if i == self._sp.unk_id() and text != self._sp.id_to_piece(i) else i

    def encode(self, text: str, add_special_tokens: bool = True, max_length: int | None = None) -> list[int]:
        """The text's ids; `max_length`: at most that many, the text's first with the special tokens
        kept (as transformers' truncation, which sentence-transformers asks for)."""
        try:
            text.encode("utf-8")  # bytes read as surrogates, or a lone surrogate from a JSON escape
        except UnicodeEncodeError:
            raise JaxinferError("the text is not valid UTF-8") from None
        if self._hf is not None:
            # tokenizer.json's post-processor adds BOS/EOS the way the model was trained.
            if max_length is None:
                return self._hf.encode(text, add_special_tokens=add_special_tokens).ids
            encoding = self._hf.encode(text, add_special_tokens=False)
            encoding.truncate(max(0, max_length - add_special_tokens * self._hf.num_special_tokens_to_add(False)))
            return self._hf.post_process(encoding, add_special_tokens=add_special_tokens).ids
        ids = self._sp_encode(text)
        before = [self.bos_id] if add_special_tokens and self.config.get("add_bos_token", True) else []
        after = [self.eos_id] if add_special_tokens and self.config.get("add_eos_token", False) else []
        before, after = [i for i in before if i is not None], [i for i in after if i is not None]
        if max_length is not None:
            ids = ids[: max(0, max_length - len(before) - len(after))]
        return before + ids + after

    def _sp_encode(self, text: str) -> list[int]:
        """sentencepiece encodes "<s>" as three characters; special tokens written in the text (as
        chat templates write them) must become their ids, as in transformers."""
        if self._specials is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._specials.split(text)):
            if i % 2:
                ids.append(self.token_id(part))
            elif part:
                ids += self._sp.encode(part)
        return ids

    def keep(self, markers) -> None:
        """Decoding keeps the text of the special tokens these markers are made of (Gemma 4's
        `<|channel>thought` of `<|channel>`), beside those kept before: a format's markers that say
        what the text around them is (`jaxinfer.harmony`, a thinking block's: `jaxinfer.replies`)."""
        for marker in markers:
            if (i := self.token_id(marker)) is not None:
                self._kept[i] = marker
                continue
            special = set(self.special_ids)
            pieces = [i for i in self.encode(marker, add_special_tokens=False) if i in special]
            self._kept |= {i: self.token_bytes(i).decode("utf-8", "replace") for i in pieces}

    def decode(self, ids: list[int]) -> str:
        """Text of ids, special tokens left out (but those kept: `keep`), and ids outside the
        vocabulary too (sentencepiece raises on them; an embedding padded past the tokenizer has such rows)."""
        if self._kept and any(i in self._kept for i in ids):
            runs, run = [], []
            for i in ids:
                if i in self._kept:
                    runs += [self._decode(run), self._kept[i]]
                    run = []
                else:
                    run.append(i)
            return "".join(runs) + self._decode(run)
        return self._decode(ids)

    def _decode(self, ids: list[int]) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._sp.decode([i for i in ids if not self._sp.is_control(i)])


class StreamDecoder:
    """Turns token ids arriving in pieces into text pieces whose concatenation is exactly the text of
    all the ids (context excluded).

    Each push decodes a short window that starts a little before the new ids, and emits what the new
    ids added to it. Windowing keeps the cost per token constant; starting the window a token back
    keeps tokenizer effects that depend on the left neighbour (sentencepiece's leading space) right,
    and a token back that added text: after a control token, its left neighbour is the one before.
    Text ending in U+FFFD is held back: the ids so far end inside a multi-byte character.
    """

    def __init__(self, tokenizer: Tokenizer, context: list[int] = ()):
        self._tok = tokenizer
        self._ids = list(context)
        self._prefix = max(0, len(self._ids) - 1)  # window start
        self._read = len(self._ids)  # ids before this are already emitted

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        done_text = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(self._ids) == self._read or (text.endswith("\ufffd") and not final):
            return ""
        if not text.startswith(done_text) and not final:  # the new ids rewrote the window: widen it
            return ""
        piece = text[len(done_text) :]
        if piece:  # ids that add no text (a control token) are no left context: the window keeps its start
            self._prefix = self._read
        self._read = len(self._ids)
        return piece
