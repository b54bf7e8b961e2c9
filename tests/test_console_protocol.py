"""Console mode (sans-IO): line editing, the command grammar with its error messages, output."""

from __future__ import annotations

import pytest

from edge_agent.protocol import console as con


def feed(editor: con.LineEditor, data: bytes) -> tuple[list[object], bytes]:
    return editor.feed(data)  # type: ignore[return-value]  # list is invariant; read as objects


@pytest.mark.parametrize("ending", [b"\r", b"\n", b"\r\n"])
def test_cr_lf_crlf_each_end_exactly_one_line(ending: bytes) -> None:
    ed = con.LineEditor()
    events, echo = ed.feed(b"help" + ending + b"jobs" + ending)
    assert events == [con.Line("help"), con.Line("jobs")]
    assert echo == b"help\r\njobs\r\n"


def test_crlf_split_across_reads_is_one_line_end() -> None:
    ed = con.LineEditor()
    assert ed.feed(b"a\r")[0] == [con.Line("a")]
    assert ed.feed(b"\nb\n")[0] == [con.Line("b")]
    assert ed.feed(b"\n")[0] == [con.Line("")]  # a second LF is a real empty line


def test_backspace_and_del_remove_whole_characters() -> None:
    ed = con.LineEditor()
    events, echo = ed.feed("gen héé".encode() + b"\x7f\x08" + b"llo\r")
    assert events == [con.Line("gen hllo")]
    assert echo == "gen héé".encode() + b"\b \b\b \bllo\r\n"
    assert ed.feed(b"\x08\x08x\r")[0] == [con.Line("x")]  # backspace on an empty line: nothing


def test_ctrl_u_clears_and_escape_sequences_are_swallowed() -> None:
    ed = con.LineEditor()
    events, echo = ed.feed(b"junk\x15he\x1b[Alp\x1bOD\r")
    assert events == [con.Line("help")]
    assert b"\x1b" not in echo


def test_ctrl_c_interrupts_and_drops_the_line() -> None:
    ed = con.LineEditor()
    events, echo = ed.feed(b"gen hel\x03status\r")
    assert events == [con.Interrupt(), con.Line("status")]
    assert echo == b"gen hel^C\r\nstatus\r\n"
    assert ed.counters["interrupts"] == 1


def test_echo_off_sends_only_line_ends() -> None:
    ed = con.LineEditor(echo=False)
    events, echo = ed.feed(b"he\x7flp\r\x03")
    assert events == [con.Line("hlp"), con.Interrupt()]
    assert echo == b"\r\n^C\r\n"


def test_overlong_line_is_refused_whole_not_truncated() -> None:
    ed = con.LineEditor(max_line=8)
    events, _ = ed.feed(b"gen 0123456789\rhelp\r")
    assert isinstance(events[0], con.InputError)
    assert events[0].message == (
        "line refused: 14 bytes, longer than the 8-byte limit; nothing was run. "
        "Hint: shorten it (the limit is the serial.max_line setting).")
    assert events[1] == con.Line("help")
    assert ed.feed(b"12345678\r")[0] == [con.Line("12345678")]  # exactly the limit is fine
    assert ed.counters["overlong"] == 1


def test_invalid_utf8_is_an_error_and_the_console_carries_on() -> None:
    ed = con.LineEditor()
    events, echo = ed.feed(b"ab\xff\xfecd\rhelp\r")
    assert events[0] == con.InputError(
        "line discarded: invalid UTF-8 (invalid start byte) at byte offset 2. "
        "Hint: set the terminal to UTF-8 and check the baud rate.")
    assert events[1] == con.Line("help")
    echo.decode("utf-8")  # the echo never reflects the garbage


def test_binary_noise_control_bytes_are_an_error() -> None:
    ed = con.LineEditor()
    events, _ = ed.feed(b"he\x01\x02lp\r")
    assert events == [con.InputError(
        "line discarded: control byte 0x01 at offset 2 (binary noise or a wrong baud rate?). "
        "Hint: check the terminal's baud rate and parity, then retype.")]
    assert ed.counters["noise"] == 1


# ----- grammar ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("line", "cmd"), [
    ("", con.Command("")),
    ("  help ", con.Command("help")),
    ("?", con.Command("help")),
    ("STATUS", con.Command("status")),
    ("models", con.Command("models")),
    ("load smollm2", con.Command("load", "smollm2")),
    ("unload tiny-1.5b", con.Command("unload", "tiny-1.5b")),
    ("chat", con.Command("chat")),
    ("cancel", con.Command("cancel")),
    ("jobs", con.Command("jobs")),
    ("flash status", con.Command("flash status")),
    ("version", con.Command("version")),
    ("gen Hello  world", con.Command("gen", "Hello  world")),
    ("gen --max-tokens 12 --temperature=0.5 --seed 7 --priority 9 Tell me",
     con.Command("gen", "Tell me", con.GenOptions(12, 0.5, 7, 9))),
    ("gen -- --not-an-option", con.Command("gen", "--not-an-option")),
    ("gen --top-k 40 --top-p=0.9 --min-p 0.05 --repeat-penalty 1.1 --repeat-last-n -1 "
     "--presence-penalty -0.5 --frequency-penalty=2 Tell me",
     con.Command("gen", "Tell me", con.GenOptions(
         top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1, repeat_last_n=-1,
         presence_penalty=-0.5, frequency_penalty=2.0))),
    ("gen --json --max-tokens 9 A cat as JSON",
     con.Command("gen", "A cat as JSON", con.GenOptions(max_tokens=9, json_object=True))),
    ("gen --schema person_2 --temperature 0 A person",
     con.Command("gen", "A person", con.GenOptions(temperature=0.0, schema="person_2"))),
    ("gen --json", None),
    ("schema", con.Command("schema")),
    ("schema person", con.Command("schema", "person")),
    ('schema person {"type": "object", "properties": {"name": {"type": "string"}}}',
     con.Command("schema", "person", schema={"type": "object", "properties": {
         "name": {"type": "string"}}})),
])
def test_grammar(line: str, cmd: con.Command | None) -> None:
    if cmd is None:  # an option alone is not text
        with pytest.raises(con.CommandError, match="no text to generate from"):
            con.parse_command(line)
        return
    assert con.parse_command(line) == cmd


@pytest.mark.parametrize(("line", "message"), [
    ("frobnicate", "unknown command 'frobnicate'. Hint: type `help` for the list."),
    ("load", "load: needs one model NAME, got nothing. Hint: `models` lists the names."),
    ("unload a b", "unload: needs one model NAME, got 'a b'. Hint: `models` lists the names."),
    ("flash now", "flash: unknown sub-command 'now'. Hint: `flash status`; flash a board with "
                  "`edge-agent flash FILE.elf`."),
    ("status now", "status: takes no arguments, got 'now'. Hint: type `status`."),
    ("gen", "gen: no text to generate from. Hint: gen Tell me about UARTs"),
    ("gen --max-tokens 5", "gen: no text to generate from. Hint: gen Tell me about UARTs"),
    ("gen --top-q 5 hi", "gen: unknown option '--top-q'. Hint: options are --max-tokens, "
                         "--temperature, --seed, --priority, --top-k, --top-p, --min-p, "
                         "--repeat-penalty, --repeat-last-n, --presence-penalty, "
                         "--frequency-penalty, --json, --schema; put -- before text that "
                         "starts with --."),
    ("gen --top-p 0 hi", "gen: --top-p '0' is not a number from 0.001 to 1.0. "
                         "Hint: e.g. --top-p 0.9"),
    ("gen --top-k 2.5 hi", "gen: --top-k '2.5' is not an integer from 0 to 1048576. "
                           "Hint: e.g. --top-k 40"),
    ("gen --min-p nan hi", "gen: --min-p 'nan' is not a number from 0.0 to 1.0. "
                           "Hint: e.g. --min-p 0.05"),
    ("gen --repeat-penalty 0 hi", "gen: --repeat-penalty '0' is not a number from 0.001 to "
                                  "100.0. Hint: e.g. --repeat-penalty 1.1"),
    ("gen --repeat-last-n -2 hi", "gen: --repeat-last-n '-2' is not an integer from -1 to "
                                  "1048576. Hint: e.g. --repeat-last-n 64"),
    ("gen --presence-penalty 3 hi", "gen: --presence-penalty '3' is not a number from -2.0 to "
                                    "2.0. Hint: e.g. --presence-penalty 0.5"),
    ("gen --frequency-penalty -inf hi", "gen: --frequency-penalty '-inf' is not a number from "
                                        "-2.0 to 2.0. Hint: e.g. --frequency-penalty 0.5"),
    ("gen --json=yes hi", "gen: option --json takes no value, got 'yes'. Hint: gen --json TEXT"),
    ("gen --schema", "gen: option --schema needs a value. Hint: e.g. --schema person"),
    ("gen --schema a.b hi", "gen: --schema 'a.b' is not a schema name (1..64 of a-z A-Z 0-9 _ "
                            "-). Hint: `schema` lists the registered names."),
    ("gen --json --schema p hi", "gen: --json and --schema together. Hint: --json for any JSON "
                                 "object, --schema NAME for one following schema NAME."),
    ("schema a/b {}", "schema: 'a/b' is not a schema name (1..64 of a-z A-Z 0-9 _ -). "
                      'Hint: schema person {"type": "object"}'),
    ("schema p [1]", 'schema p must be a JSON object (a JSON Schema), got list. Hint: e.g. '
                     '{"type": "object"}.'),
    ("schema p {'a': 1}", "schema p is not JSON (Expecting property name enclosed in double "
                          "quotes: line 1 column 2 (char 1)). Hint: check the schema text with "
                          "a JSON validator."),
    ('schema p {"a": NaN}', "schema p is not JSON (NaN is not JSON). Hint: check the schema "
                            "text with a JSON validator."),
    ("schema p " + "[" * 3000, "schema p is nested too deeply. Hint: flatten the schema."),
    ("gen --max-tokens", "gen: option --max-tokens needs a value. Hint: e.g. --max-tokens 1"),
    ("gen --max-tokens 0 hi", "gen: --max-tokens '0' is not an integer from 1 to 4096. "
                              "Hint: e.g. --max-tokens 1"),
    ("gen --priority 11 hi", "gen: --priority '11' is not an integer from 0 to 10. "
                             "Hint: e.g. --priority 10"),
    ("gen --temperature hot hi", "gen: --temperature 'hot' is not a number from 0.0 to 2.0. "
                                 "Hint: e.g. --temperature 0.0"),
    ("gen --seed -1 hi", "gen: --seed '-1' is not an integer from 0 to 4294967295. "
                         "Hint: e.g. --seed 0"),
])
def test_grammar_errors(line: str, message: str) -> None:
    with pytest.raises(con.CommandError) as e:
        con.parse_command(line)
    assert str(e.value) == message


def test_help_lists_every_command_and_gen_option() -> None:
    for name in con.COMMANDS:
        assert name in con.HELP
    for option in ("--max-tokens", "--temperature", "--seed", "--priority", "--top-k",
                   "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n",
                   "--presence-penalty", "--frequency-penalty", "--json", "--schema NAME"):
        assert option in con.HELP, option


# ----- output -------------------------------------------------------------------------------------

def test_output_uses_crlf_and_never_control_bytes() -> None:
    enc = con.OutputEncoder()
    out = enc.text("a\nb\r\nc\rd\x00e\x1b[2Jf\tg")
    assert out == "a\r\nb\r\nc\r\nd\ufffde\ufffd[2Jf\tg".encode()
    assert b"\x00" not in out


def test_crlf_split_across_pieces_is_one_line_end() -> None:
    enc = con.OutputEncoder()
    assert enc.text("x\r") + enc.text("\ny") == b"x\r\ny"
    assert enc.text("z\r") + enc.flush() == b"z\r\n"


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    enc = con.OutputEncoder()
    euro = "€".encode()
    assert enc.raw(b"price " + euro[:1]) == b"price "
    assert enc.raw(euro[1:2]) == b""
    assert enc.raw(euro[2:] + b"5") == "€5".encode()
    assert enc.raw(euro[:2]) == b""
    assert enc.flush() == "\ufffd".encode()  # an unfinished character at the end: replaced
    assert enc.line("ok") == b"ok\r\n"
