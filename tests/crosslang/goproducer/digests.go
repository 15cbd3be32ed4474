package main

// The four digests of docs/producers.md section 4, written from that page alone.

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"math"
)

const (
	prefixDomain = "nemo-gym-staging-prefix-v2"
	chainDomain  = "nemo-gym-staging-chain-v1"
	extrasDomain = "nemo-gym-staging-extras-v1"
	callDomain   = "nemo-gym-staging-call-v2"
)

func u64(n uint64) []byte { return binary.BigEndian.AppendUint64(nil, n) }

func text(s string) []byte { return append(u64(uint64(len(s))), s...) } // Go strings are UTF-8 bytes

func optText(s *string) []byte {
	if s == nil {
		return []byte{0}
	}
	return append([]byte{1}, text(*s)...)
}

func ids(xs []uint64) []byte {
	out := u64(uint64(len(xs)))
	for _, x := range xs {
		out = binary.BigEndian.AppendUint64(out, x)
	}
	return out
}

// f32s rounds each value to binary32 (Go's float32 conversion rounds to nearest even and keeps
// the sign of zero), big-endian.
func f32s(xs []float64) []byte {
	out := u64(uint64(len(xs)))
	for _, x := range xs {
		out = binary.BigEndian.AppendUint32(out, math.Float32bits(float32(x)))
	}
	return out
}

func raw32(hexDigest string) []byte {
	b, err := hex.DecodeString(hexDigest)
	if err != nil || len(b) != 32 || hex.EncodeToString(b) != hexDigest {
		panic(fmt.Sprintf("not a lowercase 64-hex digest: %q", hexDigest))
	}
	return b
}

func sha(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// cumulativeHash covers a call's full sequence (parent's tokens then its own delta).
func cumulativeHash(full []uint64) string { return sha([]byte(prefixDomain), ids(full)) }

// chainHash chains a delta to its parent's chain hash ("" for a root).
func chainHash(parent string, delta []uint64) string {
	marker := []byte{0}
	if parent != "" {
		marker = append([]byte{1}, raw32(parent)...)
	}
	return sha([]byte(chainDomain), marker, ids(delta))
}

// extrasDigest of an extras value (nil: no extras). extrasPayload is what follows the domain.
func extrasDigest(extras any) string { return sha([]byte(extrasDomain), extrasPayload(extras)) }

func extrasPayload(extras any) []byte { return encExtras(extras, []byte{1}) }

// call is what the call digest covers: the staged call's metadata and columns.
type call struct {
	RolloutID, ModelCallID string
	ParentCallID           *string
	Mode                   string
	PrevLen, DeltaLen      uint64
	CumLen, WeightVersion  uint64
	TokenIDs               []uint64
	Mask, LogProbs         []float64
	ExtrasDigest           string
	ChainHash              string
	CumulativeHash         string
}

func callDigest(c call) string {
	p := []byte{2, 2, 1}
	p = append(p, text(c.RolloutID)...)
	p = append(p, text(c.ModelCallID)...)
	p = append(p, optText(c.ParentCallID)...)
	p = append(p, text(c.Mode)...)
	for _, n := range []uint64{c.PrevLen, c.DeltaLen, c.CumLen, c.WeightVersion} {
		p = append(p, u64(n)...)
	}
	n := uint64(len(c.TokenIDs))
	p = append(p, u64(8+8*n)...)
	p = append(p, ids(c.TokenIDs)...)
	p = append(p, u64(8+4*uint64(len(c.Mask)))...)
	p = append(p, f32s(c.Mask)...)
	p = append(p, u64(8+4*uint64(len(c.LogProbs)))...)
	p = append(p, f32s(c.LogProbs)...)
	p = append(p, raw32(c.ExtrasDigest)...)
	p = append(p, 1)
	p = append(p, raw32(c.ChainHash)...)
	p = append(p, 1)
	p = append(p, raw32(c.CumulativeHash)...)
	return sha([]byte(callDomain), p)
}
