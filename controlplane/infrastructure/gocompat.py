"""Go compatibility: plinth's config values read and written as Go reads and writes them.

`parse_go_duration` and `format_go_duration` are time.ParseDuration and Duration.String,
`go_quote` is strconv.Quote (`%q`), `parse_listen_address` and `join_host_port` are
net.SplitHostPort and net.JoinHostPort: transcriptions of Go's rules, so that every input is
accepted or rejected, and every error worded, exactly as plinth does.
"""

from __future__ import annotations

import re


def parse_listen_address(address: str) -> tuple[str, int]:
    """Split a Go-style listen address (`host:port`, `[v6]:port`) for binding; an empty host
    means all interfaces. Raises ValueError naming the address."""

    def invalid(why: str) -> ValueError:
        return ValueError(f"invalid listen address {go_quote(address)}: {why}")

    # The splitting rules are Go's net.SplitHostPort.
    last_colon = address.rfind(":")
    if last_colon < 0:
        raise invalid("missing port in address")
    if address.startswith("["):
        closing = address.find("]")
        if closing < 0:
            raise invalid("missing ']' in address")
        if closing + 1 == len(address):
            raise invalid("missing port in address")
        if closing + 1 != last_colon:
            if address[closing + 1] == ":":
                raise invalid("too many colons in address")
            raise invalid("missing port in address")
        host = address[1:closing]
        no_open_bracket_from, no_close_bracket_from = 1, closing + 1
    else:
        host = address[:last_colon]
        if ":" in host:
            raise invalid("too many colons in address")
        no_open_bracket_from = no_close_bracket_from = 0
    if "[" in address[no_open_bracket_from:]:
        raise invalid("unexpected '[' in address")
    if "]" in address[no_close_bracket_from:]:
        raise invalid("unexpected ']' in address")

    port_text = address[last_colon + 1 :]
    if not re.fullmatch(r"[0-9]{1,5}", port_text) or int(port_text) > 65535:
        raise invalid(f"invalid port {go_quote(port_text)}")
    return host or "0.0.0.0", int(port_text)


def join_host_port(host: str, port: int) -> str:
    """A listen address from its halves (Go's net.JoinHostPort): an IPv6 host is bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_NANOSECONDS_PER_UNIT = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5 micro sign
    "μs": 1_000,  # U+03BC Greek small letter mu
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60 * 1_000_000_000,
    "h": 3600 * 1_000_000_000,
}
_INT64_OVERFLOW = 1 << 63
"""Go's `1<<63`: one past the largest Duration; its negation is the smallest."""


def parse_go_duration(text: str) -> int:
    """Go's time.ParseDuration, returning nanoseconds; errors are ValueErrors with Go's text.

    A transcription of Go's algorithm (including its int64 overflow checks and its float64
    arithmetic for fractions), so that every input is accepted or rejected exactly as plinth does.
    """
    rest = text
    negative = False
    if rest[:1] in ("-", "+"):
        negative = rest[0] == "-"
        rest = rest[1:]
    if rest == "0":
        return 0
    invalid_duration = ValueError(f"time: invalid duration {_go_time_quote(text)}")
    if rest == "":
        raise invalid_duration

    total = 0
    while rest:
        if not (rest[0] == "." or "0" <= rest[0] <= "9"):
            raise invalid_duration
        # The integer part: [0-9]*
        digits = _leading_digits(rest)
        rest = rest[len(digits) :]
        whole = 0
        for digit in digits:
            if whole > _INT64_OVERFLOW // 10:
                raise invalid_duration
            whole = whole * 10 + int(digit)
            if whole > _INT64_OVERFLOW:
                raise invalid_duration
        # The fraction: (\.[0-9]*)?  Digits beyond int64 precision are dropped, as in Go.
        fraction, scale, fraction_digits = 0, 1.0, ""
        if rest.startswith("."):
            fraction_digits = _leading_digits(rest[1:])
            rest = rest[1 + len(fraction_digits) :]
            for digit in fraction_digits:
                if fraction > (_INT64_OVERFLOW - 1) // 10:
                    break
                extended = fraction * 10 + int(digit)
                if extended > _INT64_OVERFLOW:
                    break
                fraction = extended
                scale *= 10
        if not digits and not fraction_digits:
            raise invalid_duration  # no digits, e.g. ".s"
        # The unit: everything up to the next digit or '.'.
        unit_name = re.match(r"[^0-9.]*", rest).group()
        if not unit_name:
            raise ValueError(f"time: missing unit in duration {_go_time_quote(text)}")
        rest = rest[len(unit_name) :]
        unit = _NANOSECONDS_PER_UNIT.get(unit_name)
        if unit is None:
            raise ValueError(
                f"time: unknown unit {_go_time_quote(unit_name)} in duration {_go_time_quote(text)}"
            )
        if whole > _INT64_OVERFLOW // unit:
            raise invalid_duration
        value = whole * unit
        if fraction > 0:
            value += int(float(fraction) * (float(unit) / scale))
            if value > _INT64_OVERFLOW:
                raise invalid_duration
        total += value
        if total > _INT64_OVERFLOW:
            raise invalid_duration
    if negative:
        return -total
    if total > _INT64_OVERFLOW - 1:
        raise invalid_duration
    return total


def _leading_digits(text: str) -> str:
    return re.match(r"[0-9]*", text).group()


def format_go_duration(nanoseconds: int) -> str:
    """Go's Duration.String: "1h2m3.5s", "1.5ms", "0s"."""
    if nanoseconds == 0:
        return "0s"
    sign = "-" if nanoseconds < 0 else ""
    magnitude = abs(nanoseconds)
    if magnitude < 1_000:
        return f"{sign}{magnitude}ns"
    if magnitude < 1_000_000:
        return f"{sign}{_decimal_text(magnitude, 3)}µs"
    if magnitude < 1_000_000_000:
        return f"{sign}{_decimal_text(magnitude, 6)}ms"
    whole_seconds, fraction = divmod(magnitude, 1_000_000_000)
    whole_minutes, seconds = divmod(whole_seconds, 60)
    hours, minutes = divmod(whole_minutes, 60)
    text = _decimal_text(seconds * 1_000_000_000 + fraction, 9) + "s"
    if whole_minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def format_go_seconds(seconds: float) -> str:
    """Float seconds (as the schema holds durations) as Duration.String writes them."""
    return format_go_duration(round(seconds * 1e9))


def _decimal_text(value: int, fraction_digits: int) -> str:
    """`value / 10**fraction_digits` without trailing zeros (and without a bare '.')."""
    whole, fraction = divmod(value, 10**fraction_digits)
    fraction_text = f"{fraction:0{fraction_digits}d}".rstrip("0")
    return f"{whole}.{fraction_text}" if fraction_text else str(whole)


def _go_time_quote(text: str) -> str:
    """The time package's own quoting in its errors: non-ASCII and control characters as \\xHH
    per UTF-8 byte, `"` and `\\` backslashed."""
    parts = []
    for char in text:
        if ord(char) >= 0x80 or char < " ":
            parts.append("".join(f"\\x{byte:02x}" for byte in char.encode("utf-8")))
        elif char in '"\\':
            parts.append("\\" + char)
        else:
            parts.append(char)
    return '"' + "".join(parts) + '"'


_GO_NAMED_ESCAPES = {
    "\a": "\\a",
    "\b": "\\b",
    "\f": "\\f",
    "\n": "\\n",
    "\r": "\\r",
    "\t": "\\t",
    "\v": "\\v",
}


def go_quote(text: str) -> str:
    """Go's strconv.Quote (`%q`): printable characters as they are, `"` and `\\` backslashed,
    the rest escaped (\\n, \\x00, \\u00a0, \\U000e0001)."""
    parts = []
    for char in text:
        code = ord(char)
        if char in '"\\':
            parts.append("\\" + char)
        elif char.isprintable():
            parts.append(char)
        elif char in _GO_NAMED_ESCAPES:
            parts.append(_GO_NAMED_ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            parts.append(f"\\x{code:02x}")
        elif code < 0x10000:
            parts.append(f"\\u{code:04x}")
        else:
            parts.append(f"\\U{code:08x}")
    return '"' + "".join(parts) + '"'
