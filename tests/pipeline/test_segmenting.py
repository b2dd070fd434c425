import pytest

from selfrag.pipeline.segmenting import ends_sentence, loops, restates_question


@pytest.mark.parametrize(
    "text",
    [
        "The Normans settled in Normandy.",
        "It happened in the year 1066.",
        'He said "stop here."',
        "Was it the tenth century?",
        "A long first line\n",
        "The default wait policy is `passive`.",
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
        "The wait policy of the engine's threads (`model.",
        "Set it in `SELFRAG_HOME/config.",
    ],
)
def test_not_sentence_ends(text):
    assert not ends_sentence(text)


def test_a_segment_that_only_repeats_the_question_is_told_from_an_answer():
    question = "On which port does `selfrag serve` listen by default?"
    assert restates_question(
        "Question:  On which port does `selfrag serve` listen by default?", question
    )
    assert restates_question("on which port does selfrag serve listen by default", question)
    assert not restates_question("It listens on port 8000 by default.", question)
    assert not restates_question(
        "On which port does `selfrag serve` listen by default? 8000.", question
    )
    assert not restates_question("", "")
    assert restates_question("Question: what is a question?", "Question: what is a question?")
    assert not restates_question("What is a question?", "Question: what is a question?")


@pytest.mark.parametrize(
    "text",
    [
        "The answer is: The answer is: The answer is: ",
        "The label `Infra-Serve-Serve-Serve-Serve-Serve-Serve-Se",
        "The server accepts a body of 1000000000000000000000000000",
        "on port 80 on port 80 on port 80 on port",
    ],
)
def test_loops(text):
    assert loops(text)


@pytest.mark.parametrize(
    "text",
    [
        "Rollo founded Normandy in 911.",
        "It cost 1,000,000 dollars in the 1990s and 2000s.",
        "It is the default preset, which is the default preset.",
        "",
    ],
)
def test_not_loops(text):
    assert not loops(text)
