"""infra/embeddings/wordpiece.py on a small vocabulary: BERT's normalisation, greedy longest
match, special tokens written in the text, unknown words and the bounded read."""

from __future__ import annotations

from selfrag.infra.embeddings.wordpiece import MAX_WORD_CHARS, WordPiece

VOCAB = [
    "[PAD]", "[UNK]", "[CLS]", "[SEP]",
    "un", "##aff", "##able", "ca", "##t", "cafe", "the", "cat", ",", ".", "!", "东", "京",
    "a", "##b",
]  # fmt: skip


def _tokenizer(**options: bool) -> WordPiece:
    settings = {"lowercase": True, "strip_accents": True, **options}
    return WordPiece(VOCAB, specials=["[CLS]", "[SEP]"], **settings)


def _pieces(tok: WordPiece, text: str) -> list[str]:
    return [VOCAB[i] for i in tok.ids(text)]


def test_the_longest_piece_matches_first_and_the_rest_continues_with_hashes():
    assert _pieces(_tokenizer(), "unaffable") == ["un", "##aff", "##able"]
    assert _pieces(_tokenizer(), "cat") == ["cat"]  # not "ca", "##t"
    assert _pieces(_tokenizer(), "abbb") == ["a", "##b", "##b", "##b"]


def test_case_and_accents_are_folded_and_punctuation_is_a_word_of_its_own():
    assert _pieces(_tokenizer(), "The CAT, café!") == ["the", "cat", ",", "cafe", "!"]
    assert _tokenizer(lowercase=False).ids("CAT") == [VOCAB.index("[UNK]")]
    assert _tokenizer(strip_accents=False).ids("café") == [VOCAB.index("[UNK]")]


def test_controls_are_dropped_and_cjk_ideographs_split_apart():
    tok = _tokenizer()
    assert tok.words("the\x00\x0bcat\u200b\tcat") == ["thecat", "cat"]
    assert tok.words("东京.") == ["东", "京", "."]


def test_a_word_with_a_part_that_matches_nothing_is_one_unknown():
    unk = VOCAB.index("[UNK]")
    assert _tokenizer().ids("catz the") == [unk, VOCAB.index("the")]
    assert _tokenizer().ids("a" * (MAX_WORD_CHARS + 1)) == [unk]


def test_a_special_token_written_in_the_text_is_that_token():
    assert _pieces(_tokenizer(), "the[SEP]cat") == ["the", "[SEP]", "cat"]


def test_a_limit_gives_the_first_ids_of_a_long_text_as_the_whole_read_would():
    tok = _tokenizer()
    text = "the cat. " * 2000
    whole = tok.ids(text)
    assert tok.ids(text, limit=5000) == whole[:5000]
    assert tok.ids("the cat", limit=10) == whole[:2]
