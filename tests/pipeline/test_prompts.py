"""pipeline/prompts.py: untrusted text cannot spell a control or reflection token, prompts are
built part by part (trusted templates with special tokens, evidence cut to its share), and a
chat template's glue is found by rendering sentinels."""

from __future__ import annotations

import pytest

from selfrag.pipeline.prompts import (
    EVIDENCE_SHARE,
    ChatGlue,
    Evidence,
    PromptBuilder,
    Tokens,
    Trusted,
    Untrusted,
    chat_glue,
    evidence_head,
    neutralise,
    passage_text,
    split_on,
)
from selfrag.pipeline.protocols import Passage

CONTROL = "<|im_start|>"
CONTROL_ID = 1000

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class CharTokenizer:
    """One id per character; with special tokens on, `<|im_start|>` is one control id."""

    def __init__(self, n_ctx: int | None = None) -> None:
        self.calls: list[tuple[str, bool]] = []
        if n_ctx is not None:
            self.n_ctx = n_ctx

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        self.calls.append((text, special))
        if special and CONTROL in text:
            head, _, tail = text.partition(CONTROL)
            return [*self.tokenize(head), CONTROL_ID, *self.tokenize(tail, special=True)]
        return [ord(c) for c in text]

    def bos_tokens(self) -> list[int]:
        return [1]


@pytest.mark.parametrize(
    "markup", ["<|im_start|>", "<|eot_id|>", "</paragraph>", "<start_of_turn>", "[Relevant]"]
)
def test_markup_in_untrusted_text_no_longer_spells_the_token(markup: str):
    text = f"see {markup} here"
    defused = neutralise(text)
    assert markup not in defused
    assert defused.replace("‹", "<").replace("［", "[") == text


def test_reflection_tokens_are_defused_whatever_their_case_and_reserved_pieces_too():
    assert "[Utility:5]" not in neutralise("[Utility:5]")
    assert "[fully supported]" not in neutralise("[fully supported]").lower()
    assert "@@sep@@" not in neutralise("a @@sep@@ b", reserved=["@@sep@@"])
    assert neutralise("plain 1 < 2 [note]") == "plain 1 < 2 [note]"


def test_trusted_parts_keep_control_tokens_and_untrusted_ones_cannot_forge_them():
    tok = CharTokenizer()
    ids = PromptBuilder(tok).build([Trusted(CONTROL), Untrusted(CONTROL), Tokens((7, 8))])
    assert ids[:2] == [1, CONTROL_ID]
    assert CONTROL_ID not in ids[2:-2]
    assert ids[-2:] == [7, 8]
    assert PromptBuilder(tok).build([Trusted("a")], bos=False) == [ord("a")]


def test_a_trusted_piece_is_tokenized_once_per_builder():
    tok = CharTokenizer()
    builder = PromptBuilder(tok)
    builder.build([Trusted("head"), Untrusted("q1")])
    builder.build([Trusted("head"), Untrusted("q2")])
    assert [call for call in tok.calls if call[0] == "head"] == [("head", True)]


def test_evidence_is_cut_to_its_share_of_the_context_among_the_passages():
    tok = CharTokenizer(n_ctx=80)
    builder = PromptBuilder(tok)
    share = 80 // EVIDENCE_SHARE
    assert len(builder.build([Evidence("x" * 100)], bos=False)) == share
    assert len(builder.build([Evidence("x" * 100, of=2)], bos=False)) == share // 2
    assert len(builder.build([Untrusted("x" * 100)], bos=False)) == 100  # a question is not cut
    assert len(PromptBuilder(CharTokenizer()).build([Evidence("x" * 100)], bos=False)) == 100


def test_build_split_counts_the_tokens_of_the_head_parts():
    builder = PromptBuilder(CharTokenizer())
    parts = [Trusted("ab"), Untrusted("cd"), Trusted("ef")]
    ids, head = builder.build_split(parts, 2)
    assert ids == builder.build(parts)
    assert head == len(builder.build(parts[:2])) == 5


def test_without_a_template_the_glue_is_a_plain_text_layout():
    glue = chat_glue(None)
    assert glue == ChatGlue("", "\n\n", "\nAnswer: ", "\n\n", has_system=True)


def test_the_glue_of_a_chatml_template_matches_what_the_template_renders():
    glue = chat_glue(CHATML)
    assert glue.start == "<|im_start|>system\n"
    assert glue.system_to_user == "<|im_end|>\n<|im_start|>user\n"
    assert glue.assistant_start == "<|im_end|>\n<|im_start|>assistant\n"
    assert glue.assistant_to_user == "<|im_end|>\n<|im_start|>user\n"
    assert glue.has_system


def test_a_template_that_refuses_a_system_message_gets_glue_without_one():
    template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        + CHATML
    )
    glue = chat_glue(template)
    assert not glue.has_system and glue.system_to_user == ""
    assert glue.start == "<|im_start|>user\n"


def test_a_template_that_renders_no_message_is_an_error():
    with pytest.raises(ValueError, match="could not be rendered"):
        chat_glue("{{ raise_exception('never') }}")


def test_split_on_cuts_at_each_sentinel_in_turn():
    assert split_on("a|b#c|d", ["|", "#", "|"]) == ["a", "b", "c", "d"]
    assert split_on("abc", ["|"]) == ["abc", ""]


def test_the_evidence_head_is_system_then_the_titled_passage():
    passage = Passage("p", "Body.", title="Title")
    assert passage_text(passage) == "Title\nBody."
    assert passage_text(Passage("q", "Only body.")) == "Only body."
    parts = evidence_head(chat_glue(None), passage)
    assert parts[-3:] == [Trusted("Passage: "), Evidence("Title\nBody.", 1), Trusted("\n\n")]
    assert evidence_head(chat_glue(None), None) == parts[:-3]
