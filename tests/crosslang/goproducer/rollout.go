package main

// Staging the calls of one rollout (docs/producers.md sections 3-6): each call's StagedCall
// value and the CallRecord its receipt repeats, with every digest computed here.

type stagedCall struct {
	value    StagedCall
	record   CallRecord
	full     []uint64 // the call's full sequence: parent's tokens then its delta
	routes   routes   // [delta_len, L, K], the last row -1 (never routed by its own call)
	boundary routes   // [1, L, K] or nil: this child's prefill route of its parent's last token
}

type rolloutBuilder struct {
	groupID, rolloutID string
	calls              map[string]*stagedCall
	order              []string
}

func newRollout(groupID, rolloutID string) *rolloutBuilder {
	return &rolloutBuilder{groupID: groupID, rolloutID: rolloutID, calls: map[string]*stagedCall{}}
}

// stage one call: parent "" for a root; rt nil for a call without routes.
func (b *rolloutBuilder) stage(id, parent string, promptDelta, generated []uint64, logprobs []float64,
	weightVersion uint64, rt, boundary routes, dtype string) *stagedCall {
	var prefix []uint64
	var parentID *string
	mode, parentChain := "text", ""
	if parent != "" {
		p := b.calls[parent]
		prefix, parentID, mode, parentChain = p.full, &parent, "token_in", p.value.ChainHash
	}
	delta := append(append([]uint64{}, promptDelta...), generated...)
	mask := make([]float64, len(delta))
	lps := make([]float64, len(delta))
	for i := range generated {
		mask[len(promptDelta)+i] = 1.0
		lps[len(promptDelta)+i] = logprobs[i]
	}
	full := append(append([]uint64{}, prefix...), delta...)
	prevLen := uint64(len(prefix))

	var extras map[string]any
	if rt != nil {
		extras = map[string]any{"routed_experts": rt.envelope(dtype)}
		if boundary != nil {
			extras["routed_experts_boundary"] = boundary.envelope(dtype)
			extras["routed_experts_boundary_index"] = int64(prevLen - 1)
		}
	}
	var extrasValue any // a nil map must digest as "no extras", not as {}
	if extras != nil {
		extrasValue = extras
	}
	c := call{RolloutID: b.rolloutID, ModelCallID: id, ParentCallID: parentID, Mode: mode,
		PrevLen: prevLen, DeltaLen: uint64(len(delta)), CumLen: prevLen + uint64(len(delta)),
		WeightVersion: weightVersion, TokenIDs: delta, Mask: mask, LogProbs: lps,
		ExtrasDigest: extrasDigest(extrasValue), ChainHash: chainHash(parentChain, delta),
		CumulativeHash: cumulativeHash(full)}
	digest := callDigest(c)
	key := b.rolloutID + "/" + id

	value := StagedCall{GroupID: b.groupID, StagingKey: key, SchemaVersion: 2, DigestVersion: 2,
		ExtrasDigestVersion: 1, RolloutID: b.rolloutID, ModelCallID: id, ParentCallID: parentID,
		Mode: mode, PrevLen: int64(c.PrevLen), DeltaLen: int64(c.DeltaLen), CumLen: int64(c.CumLen),
		WeightVersion: int64(weightVersion), Digest: digest, TokenIDsDelta: uint32Tensor(delta),
		TokenMaskDelta: float32Tensor(mask), GenerationLogProbsDelta: float32Tensor(lps),
		ExtrasDigest: c.ExtrasDigest, ChainHash: c.ChainHash, CumulativeHash: c.CumulativeHash,
		ExtrasMetadataJSON: metadataJSON(extras)}
	if rt != nil {
		value.RouteEncoding = 1
		value.RoutedExperts = rt.tensor(dtype)
		if boundary != nil {
			value.RoutedExpertsBoundary = boundary.tensor(dtype)
		}
	}
	record := CallRecord{SchemaVersion: 2, DigestVersion: 2, ExtrasDigestVersion: 1, ModelCallID: id,
		ParentCallID: parentID, PrevLen: value.PrevLen, DeltaLen: value.DeltaLen, CumLen: value.CumLen,
		WeightVersion: value.WeightVersion, Digest: digest, ExtrasDigest: c.ExtrasDigest,
		StagingKey: key, Mode: mode, ChainHash: c.ChainHash, CumulativeHash: c.CumulativeHash,
		ResponseID: "resp-" + key}
	s := &stagedCall{value: value, record: record, full: full, routes: rt, boundary: boundary}
	b.calls[id] = s
	b.order = append(b.order, id)
	return s
}

// receipt names every staged call; the terminal's chain is the row.
func (b *rolloutBuilder) receipt(terminal string) *RolloutReceipt {
	declared := "declared"
	r := &RolloutReceipt{SchemaVersion: 2, DigestVersion: 2, ExtrasDigestVersion: 1,
		RolloutID: b.rolloutID, TerminalModelCallID: &terminal, TerminalSelection: &declared}
	for _, id := range b.order {
		r.Manifest = append(r.Manifest, b.calls[id].record)
	}
	return r
}
