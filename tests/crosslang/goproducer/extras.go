package main

// Extras values (docs/producers.md sections 4 and 5): the typed encoding the extras digest
// covers, and the JSON text of extras_metadata_json. An extras value is nil, bool, int64,
// float64, string, []any or map[string]any: integers and floats stay distinct types.

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

func encExtras(v any, out []byte) []byte {
	switch x := v.(type) {
	case nil:
		return append(out, 'N')
	case bool:
		if x {
			return append(out, 'B', 1)
		}
		return append(out, 'B', 0)
	case int64:
		return binary.BigEndian.AppendUint64(append(out, 'I'), uint64(x))
	case int:
		return encExtras(int64(x), out)
	case float64:
		if math.IsNaN(x) || math.IsInf(x, 0) {
			panic("extras floats must be finite")
		}
		return binary.BigEndian.AppendUint64(append(out, 'F'), math.Float64bits(x))
	case string:
		return append(append(out, 'S'), text(x)...)
	case []any:
		out = append(append(out, 'L'), u64(uint64(len(x)))...)
		for _, item := range x {
			out = encExtras(item, out)
		}
		return out
	case map[string]any:
		out = append(append(out, 'D'), u64(uint64(len(x)))...)
		for _, k := range sortedKeys(x) { // Go compares strings by their UTF-8 bytes
			out = append(out, text(k)...)
			out = encExtras(x[k], out)
		}
		return out
	}
	panic(fmt.Sprintf("unsupported extras value %T", v))
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// metadataJSON is extras_metadata_json: the extras minus the route payloads, sorted keys, no
// whitespace, floats always with a '.' or an exponent so they parse back as floats; "null"
// for no extras at all.
func metadataJSON(extras map[string]any) string {
	if extras == nil {
		return "null"
	}
	rest := map[string]any{}
	for k, v := range extras {
		if k != "routed_experts" && k != "routed_experts_boundary" {
			rest[k] = v
		}
	}
	var b strings.Builder
	writeJSON(&b, rest)
	return b.String()
}

func writeJSON(b *strings.Builder, v any) {
	switch x := v.(type) {
	case nil:
		b.WriteString("null")
	case bool:
		b.WriteString(strconv.FormatBool(x))
	case int64:
		b.WriteString(strconv.FormatInt(x, 10))
	case int:
		b.WriteString(strconv.Itoa(x))
	case float64:
		s := strconv.FormatFloat(x, 'g', -1, 64)
		if !strings.ContainsAny(s, ".e") {
			s += ".0"
		}
		b.WriteString(s)
	case string:
		raw, _ := json.Marshal(x)
		b.Write(raw)
	case []any:
		b.WriteByte('[')
		for i, item := range x {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSON(b, item)
		}
		b.WriteByte(']')
	case map[string]any:
		b.WriteByte('{')
		for i, k := range sortedKeys(x) {
			if i > 0 {
				b.WriteByte(',')
			}
			writeJSON(b, k)
			b.WriteByte(':')
			writeJSON(b, x[k])
		}
		b.WriteByte('}')
	default:
		panic(fmt.Sprintf("unsupported extras value %T", v))
	}
}
