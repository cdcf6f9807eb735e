"""An independent reader of loom's TensorBoard event file: TFRecord framing checked with crcmod's
CRC-32C, each record parsed by the protobuf runtime against tensorflow.Event's field numbers
(event.proto, summary.proto), and every scalar compared with metrics.jsonl.
Usage: read_events.py RUN_DIR"""
import struct
import sys

import crcmod.predefined
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from metric_tags import read_rows, scalars

crc32c = crcmod.predefined.mkCrcFun("crc-32c")


def masked(crc):
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(data):
    at = 0
    while at < len(data):
        if len(data) - at < 12:
            sys.exit(f"a torn record header at byte {at}")
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        if header_crc != masked(crc32c(header)):
            sys.exit(f"record at byte {at}: the length's CRC does not match")
        body = data[at + 12:at + 12 + length]
        if len(body) != length or len(data) < at + 16 + length:
            sys.exit(f"record at byte {at}: torn")
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        if body_crc != masked(crc32c(body)):
            sys.exit(f"record at byte {at}: the data's CRC does not match")
        yield body
        at += 16 + length


def event_class():
    T = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(name="loom_check_event.proto", package="tensorflow", syntax="proto3")
    summary = f.message_type.add(name="Summary")
    value = summary.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL)
    value.field.add(name="simple_value", number=2, type=T.TYPE_FLOAT, label=T.LABEL_OPTIONAL, oneof_index=0)
    value.oneof_decl.add(name="value")
    summary.field.add(name="value", number=1, type=T.TYPE_MESSAGE, label=T.LABEL_REPEATED, type_name=".tensorflow.Summary.Value")
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=T.TYPE_DOUBLE, label=T.LABEL_OPTIONAL)
    event.field.add(name="step", number=2, type=T.TYPE_INT64, label=T.LABEL_OPTIONAL)
    event.oneof_decl.add(name="what")
    event.field.add(name="file_version", number=3, type=T.TYPE_STRING, label=T.LABEL_OPTIONAL, oneof_index=0)
    event.field.add(name="summary", number=5, type=T.TYPE_MESSAGE, label=T.LABEL_OPTIONAL, type_name=".tensorflow.Summary", oneof_index=0)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    descriptor = pool.FindMessageTypeByName("tensorflow.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(descriptor)
    return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def main():
    run = sys.argv[1]
    Event = event_class()
    with open(f"{run}/events.out.tfevents.loom", "rb") as f:
        data = f.read()
    events = []
    for body in records(data):
        e = Event()
        e.ParseFromString(body)
        if e.SerializeToString() != body:
            sys.exit("an event holds fields tensorflow.Event does not have, or encodes them unlike protobuf")
        events.append(e)
    rows = read_rows(f"{run}/metrics.jsonl")
    if not events or events[0].WhichOneof("what") != "file_version" or events[0].file_version != "brain.Event:2":
        sys.exit("the first event is not file_version brain.Event:2")
    if len(events) != len(rows) + 1:
        sys.exit(f"{len(events) - 1} scalar events for {len(rows)} metrics rows")
    tags = set()
    for e, row in zip(events[1:], rows):
        if e.step != row["step"] or e.wall_time != row["time"]:
            sys.exit(f"event at step {e.step} / time {e.wall_time} for the row at step {row['step']} / time {row['time']}")
        got = [(v.tag, v.simple_value) for v in e.summary.value]
        want = [(tag, struct.unpack("<f", struct.pack("<f", value))[0]) for tag, value in scalars(row)]
        if sorted(got) != sorted(want):
            sys.exit(f"step {row['step']}: the event holds {got}, metrics.jsonl {want}")
        tags.update(tag for tag, _ in got)
    for needed in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss", "eval/exact_match"):
        if needed not in tags:
            sys.exit(f"no {needed} scalar in the event file")
    print(f"read_events.py: {len(events)} events, {len(tags)} tags, every CRC and every scalar as metrics.jsonl has it")


main()
