import pytest

from selfrag.pipeline.segmenting import ends_sentence


@pytest.mark.parametrize(
    "text",
    [
        "The Normans settled in Normandy.",
        "It happened in the year 1066.",
        'He said "stop here."',
        "Was it the tenth century?",
        "A long first line\n",
    ],
)
def test_sentence_ends(text):
    assert ends_sentence(text)


@pytest.mark.parametrize(
    "text",
    [
        "Short.",
        "The value was 3.",
        "Music by J. S.",
        "They met Dr.",
        "The Normans settled in",
        "e.g. the Normans, etc.",
    ],
)
def test_not_sentence_ends(text):
    assert not ends_sentence(text)
