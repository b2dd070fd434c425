"""schemas/text.py: what a terminal would act on is dropped, what shows nothing is not text,
and a title is plain text whatever a client does with it."""

from __future__ import annotations

import pytest

from selfrag.schemas.text import has_visible_text, plain_title, terminal_safe


def test_terminal_safe_drops_escapes_controls_and_bidi_overrides_but_keeps_tab_and_newline():
    hostile = "a\x1b]0;owned\x07b\rc\x08d\x7fe\x9bf\u202eg\u2066h\u200fi\tj\nk"
    assert terminal_safe(hostile) == "a]0;ownedbcdefghi\tj\nk"


def test_terminal_safe_leaves_ordinary_text_alone():
    text = "Café — 東京 ✓ naïve «quoted» 1 < 2"
    assert terminal_safe(text) == text


@pytest.mark.parametrize(
    "text",
    ["", " \t\n", "\u200b\u200d\ufeff", "\x00\x1b", "\u3164\u2800", "\u00a0\u2028\u2029"],
)
def test_text_of_blanks_controls_zero_width_and_fillers_shows_nothing(text: str):
    assert not has_visible_text(text)


@pytest.mark.parametrize(
    "text",
    [
        "\x1b[2J\x07",  # clear the screen, ring the bell
        "\x1b[31;1m\x1b[0m",  # SGR colours
        "\x1b]0;owned\x07",  # OSC: retitle the window, BEL-terminated
        "\x1b]8;;https://evil.example\x1b\\\x1b]8;;\x1b\\",  # OSC 8 link, ST-terminated
        "\x1bP+q\x1b\\",  # DCS
        "\x9b2J\x9d0;t\x9c",  # 8-bit CSI and OSC
        "\x1b]0;never terminated",  # an OSC left open swallows the rest
        "\x1b(B\x1b=\x1bc",  # charset, keypad, reset
    ],
)
def test_terminal_escape_sequences_show_nothing(text: str):
    """`ESC [2J` left `[2J` behind as visible text, so a question of escapes was accepted."""
    assert not has_visible_text(text)


@pytest.mark.parametrize(
    "text", ["a", " \u200b x", "\u3164.", "東", "✓", "\x1b[1mbold\x1b[0m", "[2J", "a\x1b"]
)
def test_one_visible_character_is_visible_text(text: str):
    assert has_visible_text(text)


def test_a_title_loses_its_tags_and_controls_and_keeps_one_space_per_run():
    title = "  <b>Hello</b>\x1b\x07\n\n <i>world</i>\u202e  "
    assert plain_title(title) == "Hello world"


def test_a_stray_angle_bracket_is_escaped_not_dropped():
    assert plain_title("x < y") == "x &lt; y"
    assert plain_title("y > x") == "y &gt; x"
    assert plain_title("<script>alert(1)</script>x") == "alert(1) x"
