package main

// The Avro values of the input topics (schemas/StagedCall.avsc, schemas/ReceiptEvent.avsc,
// schemas/RouteChunk.avsc), written with every field, plain framing (docs/producers.md section 2).

import (
	"encoding/binary"
	"math"
	"os"
	"path/filepath"

	"github.com/hamba/avro/v2"
)

type PackedTensor struct {
	DType string  `avro:"dtype"`
	Shape []int64 `avro:"shape"`
	Data  []byte  `avro:"data"`
}

type StagedMedia struct {
	Imgs      PackedTensor  `avro:"imgs"`
	ImgsSizes PackedTensor  `avro:"imgs_sizes"`
	NumFrames *PackedTensor `avro:"num_frames"`
}

type GenerationTopK struct {
	IDs      PackedTensor `avro:"ids"`
	LogProbs PackedTensor `avro:"logprobs"`
}

type StagedCall struct {
	GroupID                 string          `avro:"group_id"`
	StagingKey              string          `avro:"staging_key"`
	SchemaVersion           int32           `avro:"schema_version"`
	DigestVersion           int32           `avro:"digest_version"`
	ExtrasDigestVersion     int32           `avro:"extras_digest_version"`
	RolloutID               string          `avro:"rollout_id"`
	ModelCallID             string          `avro:"model_call_id"`
	ParentCallID            *string         `avro:"parent_call_id"`
	Mode                    string          `avro:"mode"`
	PrevLen                 int64           `avro:"prev_len"`
	DeltaLen                int64           `avro:"delta_len"`
	CumLen                  int64           `avro:"cum_len"`
	WeightVersion           int64           `avro:"weight_version"`
	Digest                  string          `avro:"digest"`
	TokenIDsDelta           PackedTensor    `avro:"token_ids_delta"`
	TokenMaskDelta          PackedTensor    `avro:"token_mask_delta"`
	GenerationLogProbsDelta PackedTensor    `avro:"generation_log_probs_delta"`
	ExtrasDigest            string          `avro:"extras_digest"`
	ChainHash               string          `avro:"chain_hash"`
	CumulativeHash          string          `avro:"cumulative_hash"`
	RouteEncoding           int32           `avro:"route_encoding"`
	RoutedExperts           *PackedTensor   `avro:"routed_experts"`
	RoutedExpertsBoundary   *PackedTensor   `avro:"routed_experts_boundary"`
	ExtrasMetadataJSON      string          `avro:"extras_metadata_json"`
	Media                   *StagedMedia    `avro:"media"`
	TopK                    *GenerationTopK `avro:"topk"`
	RoutesRef               *RouteReference `avro:"routes_ref"`
}

// RouteReference: where a call's routed_experts payload was written instead of inline
// (docs/producers.md section 5, Routes by reference).
type RouteReference struct {
	Topic     string          `avro:"topic"`
	Partition int32           `avro:"partition"`
	DType     string          `avro:"dtype"`
	Shape     []int64         `avro:"shape"`
	Chunks    []RouteChunkRef `avro:"chunks"`
}

type RouteChunkRef struct {
	Offset int64  `avro:"offset"`
	Length int64  `avro:"length"`
	SHA256 string `avro:"sha256"`
}

// RouteChunk: one piece of a call's route payload (topic rollouts.staged-routes, key = group_id).
type RouteChunk struct {
	GroupID    string `avro:"group_id"`
	StagingKey string `avro:"staging_key"`
	Index      int32  `avro:"index"`
	Count      int32  `avro:"count"`
	SHA256     string `avro:"sha256"`
	Data       []byte `avro:"data"`
}

type GroupLabel struct {
	Scope string `avro:"scope"`
	Name  string `avro:"name"`
}

type ResultStat struct {
	Field string  `avro:"field"`
	Sum   float64 `avro:"sum"`
	Count int64   `avro:"count"`
}

type CallRecord struct {
	SchemaVersion           int32    `avro:"schema_version"`
	DigestVersion           int32    `avro:"digest_version"`
	ExtrasDigestVersion     int32    `avro:"extras_digest_version"`
	ModelCallID             string   `avro:"model_call_id"`
	ParentCallID            *string  `avro:"parent_call_id"`
	PrevLen                 int64    `avro:"prev_len"`
	DeltaLen                int64    `avro:"delta_len"`
	CumLen                  int64    `avro:"cum_len"`
	WeightVersion           int64    `avro:"weight_version"`
	Digest                  string   `avro:"digest"`
	ExtrasDigest            string   `avro:"extras_digest"`
	StagingKey              string   `avro:"staging_key"`
	Mode                    string   `avro:"mode"`
	ChainHash               string   `avro:"chain_hash"`
	CumulativeHash          string   `avro:"cumulative_hash"`
	ResponseID              string   `avro:"response_id"`
	AdmittedAt              *float64 `avro:"admitted_at"`
	OutputFingerprint       *string  `avro:"output_fingerprint"`
	ContinuationFingerprint *string  `avro:"continuation_fingerprint"`
	FingerprintVersion      int64    `avro:"fingerprint_version"`
}

type RolloutReceipt struct {
	SchemaVersion             int32        `avro:"schema_version"`
	DigestVersion             int32        `avro:"digest_version"`
	ExtrasDigestVersion       int32        `avro:"extras_digest_version"`
	RolloutID                 string       `avro:"rollout_id"`
	Reward                    *float64     `avro:"reward"`
	TerminalModelCallID       *string      `avro:"terminal_model_call_id"`
	Manifest                  []CallRecord `avro:"manifest"`
	CapturePoisoned           bool         `avro:"capture_poisoned"`
	FailureReason             *string      `avro:"failure_reason"`
	TerminalSelection         *string      `avro:"terminal_selection"`
	TerminalAttributionReason *string      `avro:"terminal_attribution_reason"`
}

type ReceiptEvent struct {
	GroupID               string          `avro:"group_id"`
	RolloutID             string          `avro:"rollout_id"`
	RolloutIndex          int32           `avro:"rollout_index"`
	GroupSize             int32           `avro:"group_size"`
	PromptIdx             int64           `avro:"prompt_idx"`
	Reward                float64         `avro:"reward"`
	MaskSample            bool            `avro:"mask_sample"`
	LossMultiplier        float64         `avro:"loss_multiplier"`
	FallbackWeightVersion int64           `avro:"fallback_weight_version"`
	CanonicalSampleID     *string         `avro:"canonical_sample_id"`
	Labels                []GroupLabel    `avro:"labels"`
	ResultStats           []ResultStat    `avro:"result_stats"`
	Receipt               *RolloutReceipt `avro:"receipt"`
}

type schemas struct{ staged, receipt, chunk avro.Schema }

// loadSchemas parses PackedTensor.avsc before StagedCall.avsc, which names it.
func loadSchemas(dir string) (schemas, error) {
	cache := &avro.SchemaCache{}
	var out schemas
	for _, step := range []struct {
		file string
		into *avro.Schema
	}{{"PackedTensor.avsc", nil}, {"StagedCall.avsc", &out.staged}, {"ReceiptEvent.avsc", &out.receipt},
		{"RouteChunk.avsc", &out.chunk}} {
		raw, err := os.ReadFile(filepath.Join(dir, step.file))
		if err != nil {
			return out, err
		}
		s, err := avro.ParseBytesWithCache(raw, "", cache)
		if err != nil {
			return out, err
		}
		if step.into != nil {
			*step.into = s
		}
	}
	return out, nil
}

func uint32Tensor(xs []uint64) PackedTensor {
	var data []byte
	for _, x := range xs {
		if x > math.MaxUint32 {
			panic("token id does not fit uint32")
		}
		data = binary.LittleEndian.AppendUint32(data, uint32(x))
	}
	return PackedTensor{DType: "uint32", Shape: []int64{int64(len(xs))}, Data: data}
}

func float32Tensor(xs []float64) PackedTensor {
	var data []byte
	for _, x := range xs {
		data = binary.LittleEndian.AppendUint32(data, math.Float32bits(float32(x)))
	}
	return PackedTensor{DType: "float32", Shape: []int64{int64(len(xs))}, Data: data}
}
