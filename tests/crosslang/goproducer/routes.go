package main

// Route payloads (docs/producers.md section 5): the dtype rule, the PackedTensor of a route
// tensor [T, L, K] and its nrlre1 envelope over the same bytes.

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"fmt"
)

// routes is a route tensor [tokens][layers][topk]; -1 means "no route".
type routes [][][]int

func routeDType(experts int) string {
	switch {
	case experts <= 0:
		return "int16" // unknown expert count
	case experts-1 <= 127:
		return "int8"
	case experts-1 <= 32767:
		return "int16"
	}
	return "int32"
}

func (r routes) shape() (int, int, int) { return len(r), len(r[0]), len(r[0][0]) }

// bytes: row-major, each value little-endian in dtype.
func (r routes) bytes(dtype string) []byte {
	var out []byte
	for _, token := range r {
		for _, layer := range token {
			for _, e := range layer {
				switch dtype {
				case "int8":
					if e < -128 || e > 127 {
						panic(fmt.Sprintf("route %d does not fit int8", e))
					}
					out = append(out, byte(int8(e)))
				case "int16":
					out = binary.LittleEndian.AppendUint16(out, uint16(int16(e)))
				case "int32":
					out = binary.LittleEndian.AppendUint32(out, uint32(int32(e)))
				default:
					panic("route dtype " + dtype)
				}
			}
		}
	}
	return out
}

func (r routes) tensor(dtype string) *PackedTensor {
	t, l, k := r.shape()
	return &PackedTensor{DType: dtype, Shape: []int64{int64(t), int64(l), int64(k)}, Data: r.bytes(dtype)}
}

func (r routes) envelope(dtype string) string {
	t, l, k := r.shape()
	return fmt.Sprintf("nrlre1:%s:%dx%dx%d:%s", dtype, t, l, k, base64.StdEncoding.EncodeToString(r.bytes(dtype)))
}

// routeChunk is one piece of a call's route payload, before it is written.
type routeChunk struct {
	data   []byte
	sha256 string // lowercase hex SHA-256 of data
}

// splitPayload cuts the payload (the PackedTensor's data: little-endian, C order) into pieces
// of at most size bytes, in order; each names its SHA-256.
func splitPayload(payload []byte, size int) []routeChunk {
	var out []routeChunk
	for at := 0; at < len(payload); at += size {
		end := min(at+size, len(payload))
		sum := sha256.Sum256(payload[at:end])
		out = append(out, routeChunk{data: payload[at:end], sha256: hex.EncodeToString(sum[:])})
	}
	return out
}
