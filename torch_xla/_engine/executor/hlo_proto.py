"""XLA's `HloModuleProto` as protobuf text format and as protobuf JSON, without protobuf.

jaxlib hands the program over as a serialized `xla.HloModuleProto` but ships no message
descriptors; this module decodes the wire format with a table of the fields of XLA's
`hlo.proto` / `xla_data.proto` that describe a module's structure (computations,
instructions, shapes, layouts, metadata, stack frames, literals, aliasing). As a reader
of an older schema would, the text form prints any other field by number and the JSON
form leaves it out.
"""
from __future__ import annotations

import base64
import json
import struct
from typing import Dict, List, Tuple

# kinds: s string, b bytes, i int64, u uint64, i32 int32, f float, d double, ? bool,
# e:<Enum>, m:<Message>; a trailing "*" marks a repeated field.
_SLICE = {1: ("start", "i"), 2: ("limit", "i"), 3: ("stride", "i")}
_MSGS: Dict[str, Dict[int, Tuple[str, str]]] = {
    "HloModuleProto": {1: ("name", "s"), 2: ("entry_computation_name", "s"), 6: ("entry_computation_id", "i"),
                       3: ("computations", "m:HloComputationProto*"), 4: ("host_program_shape", "m:ProgramShapeProto"),
                       5: ("id", "i"), 8: ("input_output_alias", "m:HloInputOutputAliasProto"),
                       18: ("buffer_donor", "m:HloBufferDonorProto"), 11: ("is_dynamic", "?"),
                       16: ("use_auto_spmd_partitioning", "?"), 15: ("device_assignment", "m:DeviceAssignmentProto"),
                       17: ("stack_frame_index", "m:StackFrameIndexProto")},
    "HloComputationProto": {1: ("name", "s"), 2: ("instructions", "m:HloInstructionProto*"),
                            4: ("program_shape", "m:ProgramShapeProto"), 5: ("id", "i"), 6: ("root_id", "i"),
                            7: ("is_fusion_computation", "?"), 8: ("execution_thread", "s")},
    "HloInstructionProto": {
        1: ("name", "s"), 2: ("opcode", "s"), 3: ("shape", "m:ShapeProto"), 7: ("metadata", "m:OpMetadata"),
        8: ("literal", "m:LiteralProto"), 9: ("parameter_number", "i"), 11: ("fusion_kind", "s"),
        13: ("tuple_index", "i"), 14: ("dimensions", "i*"), 15: ("window", "m:Window"),
        50: ("feature_group_count", "i"), 58: ("batch_group_count", "i"),
        17: ("slice_dimensions", "m:SliceDimensions*"), 18: ("exponent_bits", "i32"), 19: ("mantissa_bits", "i32"),
        20: ("dynamic_slice_sizes", "i*"), 21: ("padding_config", "m:PaddingConfig"), 24: ("epsilon", "f"),
        25: ("feature_index", "i"), 26: ("channel_id", "i"), 28: ("custom_call_target", "s"),
        30: ("dot_dimension_numbers", "m:DotDimensionNumbers"), 32: ("fft_length", "i*"),
        63: ("comparison_direction", "s"), 33: ("gather_dimension_numbers", "m:GatherDimensionNumbers"),
        34: ("gather_slice_sizes", "i*"), 35: ("id", "i"), 36: ("operand_ids", "i*"),
        37: ("control_predecessor_ids", "i*"), 38: ("called_computation_ids", "i*"), 43: ("backend_config", "b"),
        48: ("scatter_dimension_numbers", "m:ScatterDimensionNumbers"), 60: ("is_stable", "?"),
        67: ("indices_are_sorted", "?"), 69: ("unique_indices", "?"), 71: ("use_global_device_ids", "?"),
        72: ("comparison_type", "s"), 79: ("async_execution_thread", "s"), 81: ("k", "i"), 85: ("largest", "?"),
        89: ("is_composite", "?")},
    "SliceDimensions": _SLICE,
    "ShapeProto": {2: ("element_type", "e:PrimitiveType"), 3: ("dimensions", "i*"), 6: ("is_dynamic_dimension", "?*"),
                   4: ("tuple_shapes", "m:ShapeProto*"), 5: ("layout", "m:LayoutProto")},
    "LayoutProto": {1: ("minor_to_major", "i*"), 6: ("tiles", "m:TileProto*"), 16: ("tail_padding_alignment_in_elements", "i"),
                    7: ("element_size_in_bits", "i"), 8: ("memory_space", "i"),
                    15: ("dynamic_shape_metadata_prefix_bytes", "i")},
    "TileProto": {1: ("dimensions", "i*")},
    "ProgramShapeProto": {1: ("parameters", "m:ShapeProto*"), 2: ("result", "m:ShapeProto"),
                          3: ("parameter_names", "s*")},
    "OpMetadata": {1: ("op_type", "s"), 2: ("op_name", "s"), 3: ("source_file", "s"), 4: ("source_line", "i32"),
                   17: ("source_end_line", "i32"), 18: ("source_column", "i32"), 19: ("source_end_column", "i32"),
                   8: ("size_of_generated_code_in_bytes", "i"), 9: ("size_of_memory_working_set_in_bytes", "i"),
                   12: ("deduplicated_name", "s"), 15: ("stack_frame_id", "i32"), 16: ("scheduling_name", "s")},
    "StackFrameIndexProto": {1: ("file_names", "s*"), 2: ("function_names", "s*"),
                             3: ("file_locations", "m:FileLocation*"), 4: ("stack_frames", "m:StackFrame*")},
    "FileLocation": {1: ("file_name_id", "i32"), 2: ("function_name_id", "i32"), 3: ("line", "i32"),
                     4: ("column", "i32")},
    "StackFrame": {1: ("file_location_id", "i32"), 2: ("parent_frame_id", "i32")},
    "LiteralProto": {1: ("shape", "m:ShapeProto"), 2: ("preds", "?*"), 3: ("u8s", "b"), 15: ("s8s", "b"),
                     4: ("s32s", "i32*"), 5: ("s64s", "i*"), 6: ("u32s", "u*"), 7: ("u64s", "u*"), 8: ("f32s", "f*"),
                     9: ("f64s", "d*"), 12: ("c64s", "f*"), 18: ("c128s", "d*"), 10: ("tuple_literals", "m:LiteralProto*"),
                     11: ("f16s", "b"), 13: ("bf16s", "b"), 16: ("u16s", "b"), 17: ("s16s", "b")},
    "Window": {1: ("dimensions", "m:WindowDimension*")},
    "WindowDimension": {1: ("size", "i"), 2: ("stride", "i"), 3: ("padding_low", "i"), 4: ("padding_high", "i"),
                        5: ("window_dilation", "i"), 6: ("base_dilation", "i"), 7: ("window_reversal", "?")},
    "PaddingConfig": {1: ("dimensions", "m:PaddingConfigDimension*")},
    "PaddingConfigDimension": {1: ("edge_padding_low", "i"), 2: ("edge_padding_high", "i"),
                               3: ("interior_padding", "i")},
    "DotDimensionNumbers": {1: ("lhs_contracting_dimensions", "i*"), 2: ("rhs_contracting_dimensions", "i*"),
                            3: ("lhs_batch_dimensions", "i*"), 4: ("rhs_batch_dimensions", "i*")},
    "GatherDimensionNumbers": {1: ("offset_dims", "i*"), 2: ("collapsed_slice_dims", "i*"),
                               3: ("start_index_map", "i*"), 4: ("index_vector_dim", "i"),
                               5: ("operand_batching_dims", "i*"), 6: ("start_indices_batching_dims", "i*")},
    "ScatterDimensionNumbers": {1: ("update_window_dims", "i*"), 2: ("inserted_window_dims", "i*"),
                                3: ("scatter_dims_to_operand_dims", "i*"), 4: ("index_vector_dim", "i"),
                                5: ("input_batching_dims", "i*"), 6: ("scatter_indices_batching_dims", "i*")},
    "HloInputOutputAliasProto": {1: ("entries", "m:AliasEntryProto*")},
    "AliasEntryProto": {1: ("output_shape_index", "i*"), 2: ("parameter_number", "i"),
                        3: ("parameter_shape_index", "i*"), 4: ("kind", "e:Kind")},
    "HloBufferDonorProto": {1: ("entries", "m:BufferDonorEntryProto*")},
    "BufferDonorEntryProto": {1: ("parameter_number", "i"), 2: ("parameter_shape_index", "i*")},
    "DeviceAssignmentProto": {1: ("replica_count", "i32"), 2: ("computation_count", "i32"),
                              3: ("computation_devices", "m:ComputationDevice*")},
    "ComputationDevice": {1: ("replica_device_ids", "i*")},
}
_ENUMS = {
    "PrimitiveType": {0: "PRIMITIVE_TYPE_INVALID", 1: "PRED", 2: "S8", 3: "S16", 4: "S32", 5: "S64", 6: "U8",
                      7: "U16", 8: "U32", 9: "U64", 10: "F16", 11: "F32", 12: "F64", 13: "TUPLE",
                      14: "OPAQUE_TYPE", 15: "C64", 16: "BF16", 17: "TOKEN", 18: "C128", 21: "S4", 22: "U4",
                      26: "S2", 27: "U2", 30: "S1", 31: "U1"},
    "Kind": {0: "UNDEFINED_ALIAS", 1: "MAY_ALIAS", 2: "MUST_ALIAS"},
}
_FIXED = {"f": ("<f", 4), "d": ("<d", 8)}


def _varint(buf: bytes, pos: int) -> Tuple[int, int]:
    out = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if b < 0x80:
            return out, pos
        shift += 7


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _scalar(kind: str, v: int):
    if kind in ("i", "i32"):
        return _signed(v)
    if kind == "?":
        return bool(v)
    return v


def decode(buf: bytes, msg: str = "HloModuleProto") -> List[Tuple[int, str, object]]:
    """The fields of message `msg` in `buf`, in wire order: (number, kind, value); a
    nested message's value is its own field list; an unknown field's kind is "?wire"."""
    table = _MSGS.get(msg, {})
    out: List[Tuple[int, str, object]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wire = key >> 3, key & 7
        kind = table.get(num, (None, "?wire"))[1].rstrip("*")
        if wire == 0:
            v, pos = _varint(buf, pos)
            out.append((num, kind, _scalar(kind, v) if kind != "?wire" else v))
        elif wire == 1 or wire == 5:
            n = 8 if wire == 1 else 4
            raw = buf[pos:pos + n]
            pos += n
            if kind in _FIXED:
                out.append((num, kind, struct.unpack(_FIXED[kind][0], raw)[0]))
            else:
                out.append((num, "?wire", int.from_bytes(raw, "little")))
        elif wire == 2:
            n, pos = _varint(buf, pos)
            raw = buf[pos:pos + n]
            pos += n
            if kind.startswith("m:"):
                out.append((num, kind, decode(raw, kind[2:])))
            elif kind == "s":
                out.append((num, kind, raw.decode("utf-8", "replace")))
            elif kind in _FIXED:  # packed floats / doubles
                fmt, size = _FIXED[kind]
                out.extend((num, kind, struct.unpack(fmt, raw[k:k + size])[0]) for k in range(0, len(raw), size))
            elif kind in ("i", "i32", "u", "?") or kind.startswith("e:"):  # packed varints
                p = 0
                while p < len(raw):
                    v, p = _varint(raw, p)
                    out.append((num, kind, _scalar(kind, v)))
            else:
                out.append((num, kind if kind == "b" else "?wire", raw))
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in {msg}")
    return out


def _name(msg: str, num: int) -> str:
    return _MSGS.get(msg, {}).get(num, (str(num),))[0]


def _text_value(kind: str, v) -> str:
    if kind.startswith("e:"):
        return _ENUMS[kind[2:]].get(v, str(v))
    if kind == "?":
        return "true" if v else "false"
    if kind in ("s", "b") or isinstance(v, (bytes, str)):
        raw = v.encode("utf-8") if isinstance(v, str) else v
        return '"' + "".join(chr(c) if 32 <= c < 127 and chr(c) not in '"\\' else f"\\{c:03o}" for c in raw) + '"'
    return repr(v) if isinstance(v, float) else str(v)


def to_text(fields, msg: str = "HloModuleProto", indent: int = 0) -> str:
    """Protobuf text format of decoded `fields`."""
    pad = "  " * indent
    lines = []
    for num, kind, v in fields:
        name = _name(msg, num)
        if kind.startswith("m:"):
            lines.append(f"{pad}{name} {{\n{to_text(v, kind[2:], indent + 1)}{pad}}}\n")
        else:
            lines.append(f"{pad}{name}: {_text_value(kind, v)}\n")
    return "".join(lines)


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def to_dict(fields, msg: str = "HloModuleProto") -> dict:
    """Protobuf's JSON mapping of decoded `fields` (lowerCamelCase names, 64-bit integers
    as strings, enums by name, bytes in base64); unknown fields are left out."""
    table = _MSGS.get(msg, {})
    out: dict = {}
    for num, kind, v in fields:
        if num not in table:
            continue
        name, spec = table[num]
        if kind.startswith("m:"):
            v = to_dict(v, kind[2:])
        elif kind.startswith("e:"):
            v = _ENUMS[kind[2:]].get(v, v)
        elif kind in ("i", "u"):
            v = str(v)
        elif kind == "b":
            v = base64.b64encode(v).decode("ascii")
        key = _camel(name)
        if spec.endswith("*"):
            out.setdefault(key, []).append(v)
        else:
            out[key] = v
    return out


def to_json(fields, msg: str = "HloModuleProto") -> str:
    return json.dumps(to_dict(fields, msg), indent=2)


def renamed(buf: bytes, name: str) -> bytes:
    """The serialized module `buf` with its `name` field set to `name`."""
    out = bytearray()
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            pos += n
        if key >> 3 != 1:
            out += buf[start:pos]
    raw = name.encode("utf-8")
    head = bytearray([0x0A])
    n = len(raw)
    while True:
        head.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            break
    return bytes(head + raw + out)
