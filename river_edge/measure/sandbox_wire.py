"""Plain Python values as JSON, both ways, between the sandboxed solution and the tests that judge it: only exact
built-in types cross (an object whose __eq__ always says True cannot), and a decoder for input written by the
program. Standalone (json only): the sandbox copies this text into the program it runs."""
import json

_SEQ = {list: "l", tuple: "t", set: "S", frozenset: "F"}
_UNSEQ = {v: k for k, v in _SEQ.items()}
WIRE_LIMIT = 16 << 20   # bytes of one message


def wire_encode(x, depth=0):
    t = type(x)
    if depth > 100:
        raise TypeError("a value nested over 100 deep")
    if x is None or t in (bool, int, float, str):
        return x
    if t in _SEQ:
        return [_SEQ[t], [wire_encode(v, depth + 1) for v in x]]
    if t is dict:
        return ["d", [[wire_encode(k, depth + 1), wire_encode(v, depth + 1)] for k, v in x.items()]]
    if t is bytes:
        return ["b", x.hex()]
    if t is complex:
        return ["c", x.real, x.imag]
    raise TypeError(f"a {t.__name__}, not a plain value")


def wire_decode(j, depth=0):
    if depth > 100:
        raise ValueError("a value nested over 100 deep")
    if j is None or type(j) in (bool, int, float, str):
        return j
    if type(j) is not list or not j or j[0] not in ("l", "t", "S", "F", "d", "b", "c"):
        raise ValueError("not a wire value")
    tag = j[0]
    if tag == "b":
        return bytes.fromhex(j[1])
    if tag == "c":
        return complex(float(j[1]), float(j[2]))
    if tag == "d":
        return {wire_decode(k, depth + 1): wire_decode(v, depth + 1) for k, v in j[1]}
    return _UNSEQ[tag](wire_decode(v, depth + 1) for v in j[1])


def wire_dumps(x) -> bytes:
    return json.dumps(wire_encode(x)).encode() + b"\n"


def wire_loads(line: bytes):
    if len(line) >= WIRE_LIMIT or not line.endswith(b"\n"):
        raise ValueError("a message over the size limit, or cut short")
    return wire_decode(json.loads(line))
