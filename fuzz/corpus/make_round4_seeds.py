#!/usr/bin/env python3
"""Writes the seeds of issue 67's hostile shapes (round four) into fuzz/corpus/: Parquet footers
whose column chunks share one stretch of the file, run past its end or name a column twice
(fuzz_columnar), and CSV, TSV and JSON files with byte-order marks, a header naming a column twice
and Latin-1 bytes (fuzz_jsonl: the format on the first line, the file after it). The fuzzers grow
these into their neighbours; tests/hostile_input_test.cpp holds each shape at its full size.
    python3 fuzz/corpus/make_round4_seeds.py"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
I32, I64, BINARY, LIST, STRUCT = 5, 6, 8, 9, 12


class Compact:
    """Thrift's compact protocol, as Parquet's footer is written."""

    def __init__(self):
        self.out = bytearray()
        self.last = [0]

    def varint(self, v):
        while v >= 0x80:
            self.out.append((v & 0x7F) | 0x80)
            v >>= 7
        self.out.append(v)

    def field(self, fid, ftype):
        delta = fid - self.last[-1]
        if 0 < delta <= 15:
            self.out.append((delta << 4) | ftype)
        else:
            self.out.append(ftype)
            self.varint((fid << 1) ^ (fid >> 63))
        self.last[-1] = fid

    def int(self, fid, ftype, v):
        self.field(fid, ftype)
        self.varint((v << 1) ^ (v >> 63))

    def binary(self, fid, data):
        self.field(fid, BINARY)
        self.varint(len(data))
        self.out += data

    def struct_list(self, fid, n):
        self.field(fid, LIST)
        if n < 15:
            self.out.append((n << 4) | STRUCT)
        else:
            self.out.append(0xF0 | STRUCT)
            self.varint(n)

    def begin(self):
        self.last.append(0)

    def end(self):
        self.out.append(0)
        self.last.pop()


def parquet(names, chunk, claimed):
    """One row group whose string columns `names` all claim `claimed` bytes at offset 4."""
    w = Compact()
    w.begin()
    w.int(1, I32, 1)
    w.struct_list(2, len(names) + 1)
    w.begin()
    w.binary(4, b"schema")
    w.int(5, I32, len(names))
    w.end()
    for name in names:
        w.begin()
        w.int(1, I32, 6)
        w.int(3, I32, 0)
        w.binary(4, name.encode())
        w.end()
    w.int(3, I64, 1)
    w.struct_list(4, 1)
    w.begin()
    w.struct_list(1, len(names))
    for name in names:
        w.begin()
        w.int(2, I64, 4)
        w.field(3, STRUCT)
        w.begin()
        w.int(1, I32, 6)
        w.field(3, LIST)
        w.out.append((1 << 4) | BINARY)
        w.varint(len(name))
        w.out += name.encode()
        w.int(4, I32, 0)
        w.int(5, I64, 1)
        w.int(6, I64, claimed)
        w.int(7, I64, claimed)
        w.int(9, I64, 4)
        w.end()
        w.end()
    w.int(2, I64, claimed)
    w.int(3, I64, 1)
    w.end()
    w.end()
    footer = bytes(w.out)
    return b"PAR1" + b"x" * chunk + footer + struct.pack("<I", len(footer)) + b"PAR1"


def write(target, name, data):
    with open(os.path.join(HERE, target, name), "wb") as f:
        f.write(data)


write("fuzz_columnar", "round4-chunks-overlap.parquet", parquet(["text"] + ["c%d" % i for i in range(1, 64)], 256, 256))
write("fuzz_columnar", "round4-chunk-past-end.parquet", parquet(["text"], 8, 1 << 20))
write("fuzz_columnar", "round4-column-twice.parquet", parquet(["text", "text"], 8, 8))
BOM = b"\xef\xbb\xbf"
write("fuzz_jsonl", "round4-bom-csv", b"{text} {n}\n" + BOM + b"text,n\none,1\ntwo,2\n")
write("fuzz_jsonl", "round4-bom-array", b"{text}\n" + BOM + b'[{"text": "one"}, {"text": "two"}]')
write("fuzz_jsonl", "round4-bom-lines", b"{text}\n" + BOM + b'{"text": "one"}\n{"text": "two"}\n')
write("fuzz_jsonl", "round4-header-twice", b"{text}\ntext,n,text\na,1,b\n")
write("fuzz_jsonl", "round4-latin1", b"{instruction} {output}\ninstruction,output\ncaf\xe9,oui\n")
