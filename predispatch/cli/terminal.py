"""Text for a terminal: what a file says is shown, never obeyed.

A saved program carries strings its maker chose (input paths, shape guards, the origins of
symbols, stack traces, class names), and `predispatch show` prints them.  A terminal obeys
the control characters in what it prints: `ESC [ 2 J` clears the screen, `ESC ] 0 ; ... BEL`
sets the window title, `ESC ] 52 ; c ; ...` (OSC 52) writes the clipboard, a carriage return
overwrites the line, and the C1 controls (`\\x9b`, one-byte CSI) do the same on terminals
that read them.  Every text the command line writes that may hold file text goes through
`visible`: each control character becomes its Python escape, so the text shows what the file
holds and the terminal does nothing.
"""

from __future__ import annotations

import unicodedata

#: Characters a terminal or a text viewer acts on rather than shows, besides the newline and
#: the tab the command line's own text is laid out with: C0 (but \n, \t), DEL, C1 (Unicode's
#: category Cc), and the bidirectional controls, which reorder what is shown.
_BIDI = (0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_HIDDEN = {code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
           for code in (*range(0x20), *range(0x7F, 0xA0), *_BIDI)
           if code not in (0x0A, 0x09) and (code in _BIDI or unicodedata.category(chr(code)) == "Cc")}


def visible(text: str) -> str:
    """`text` with every control character but the newline and the tab written as its escape
    (`\\x1b`, `\\x9b`, `\\u202e`): an escape sequence in a file is shown, not run."""
    return text.translate(_HIDDEN)
