package main

// The workload: G groups x N rollouts, each a multi-turn chain (a text root, then token_in
// children) with MoE routes and boundary sidecars, one rollout per group without a receipt.
// Each rollout also records what the stage must publish for it.

import (
	"fmt"
	"math/rand/v2"
)

type workloadConfig struct {
	Prefix                                          string
	Groups, GroupSize, Turns, Layers, TopK, Experts int
	Seed                                            uint64
	Tamper                                          string // "", "boundary" or "token": rollout `tampered` of each group
}

type rolloutPlan struct {
	RolloutID         string    `json:"rollout_id"`
	RolloutIndex      int       `json:"rollout_index"`
	HasReceipt        bool      `json:"receipt"`
	Tampered          string    `json:"tampered,omitempty"`
	InputIDs          []uint64  `json:"input_ids"`
	TokenMask         []float64 `json:"token_mask"`
	LogProbs          []float64 `json:"logprobs"`
	Routes            routes    `json:"routed_experts"`     // the row's expected [T, L, K] routes
	BoundaryPositions []int     `json:"boundary_positions"` // rows repaired from a child's sidecar
	calls             []*stagedCall
	receipt           *RolloutReceipt
}

type groupPlan struct {
	GroupID  string         `json:"group_id"`
	Rollouts []*rolloutPlan `json:"rollouts"`
}

func buildWorkload(cfg workloadConfig) []*groupPlan {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x9e3779b9))
	dtype := routeDType(cfg.Experts)
	var groups []*groupPlan
	for g := 0; g < cfg.Groups; g++ {
		group := &groupPlan{GroupID: fmt.Sprintf("%s%d", cfg.Prefix, g)}
		missing := g % cfg.GroupSize
		for i := 0; i < cfg.GroupSize; i++ {
			r := buildRollout(rng, cfg, dtype, group.GroupID, i)
			r.HasReceipt = i != missing
			if cfg.Tamper != "" && i == (missing+1)%cfg.GroupSize {
				tamper(r, cfg.Tamper)
			}
			group.Rollouts = append(group.Rollouts, r)
		}
		groups = append(groups, group)
	}
	return groups
}

func buildRollout(rng *rand.Rand, cfg workloadConfig, dtype, groupID string, index int) *rolloutPlan {
	b := newRollout(groupID, fmt.Sprintf("%s-r%d", groupID, index))
	plan := &rolloutPlan{RolloutID: b.rolloutID, RolloutIndex: index}
	parent := ""
	for t := 0; t < cfg.Turns; t++ {
		promptLen, genLen := 6, 2+rng.IntN(4)
		if t > 0 {
			promptLen = 1 + rng.IntN(3) // the tool output / next user turn
		}
		prompt, gen := tokens(rng, promptLen), tokens(rng, genLen)
		lps := make([]float64, genLen)
		for j := range lps {
			lps[j] = float64(float32(-0.01 - 5*rng.Float64())) // what travels as float32
		}
		rt := randomRoutes(rng, promptLen+genLen, cfg)
		rt[len(rt)-1] = noRoute(cfg) // the engine never routes a call's last sampled token
		var boundary routes
		if t > 0 { // the child's prefill routes its parent's last token
			boundary = randomRoutes(rng, 1, cfg)
		}
		id := fmt.Sprintf("c%d", t)
		call := b.stage(id, parent, prompt, gen, lps, uint64(3+t), rt, boundary, dtype)
		if boundary != nil {
			at := int(call.value.PrevLen) - 1
			plan.Routes[at] = boundary[0]
			plan.BoundaryPositions = append(plan.BoundaryPositions, at)
		}
		plan.Routes = append(plan.Routes, rt...)
		for j := 0; j < promptLen; j++ {
			plan.TokenMask, plan.LogProbs = append(plan.TokenMask, 0), append(plan.LogProbs, 0)
		}
		for _, lp := range lps {
			plan.TokenMask, plan.LogProbs = append(plan.TokenMask, 1), append(plan.LogProbs, lp)
		}
		plan.calls = append(plan.calls, call)
		parent = id
	}
	plan.InputIDs = b.calls[parent].full
	plan.receipt = b.receipt(parent)
	return plan
}

// tamper changes a staged column after its digests were computed: the stage must reject it.
func tamper(r *rolloutPlan, how string) {
	r.Tampered = how
	switch how {
	case "boundary": // the first child's sidecar no longer matches its extras digest
		r.calls[1].value.RoutedExpertsBoundary.Data[0] ^= 1
	case "token": // the root's first token no longer matches its call digest
		r.calls[0].value.TokenIDsDelta.Data[0] ^= 1
	default:
		panic("unknown tamper " + how)
	}
}

func tokens(rng *rand.Rand, n int) []uint64 {
	out := make([]uint64, n)
	for i := range out {
		out[i] = rng.Uint64N(50_000)
	}
	return out
}

func randomRoutes(rng *rand.Rand, n int, cfg workloadConfig) routes {
	out := make(routes, n)
	for t := range out {
		out[t] = make([][]int, cfg.Layers)
		for l := range out[t] {
			out[t][l] = make([]int, cfg.TopK)
			for k := range out[t][l] {
				out[t][l][k] = rng.IntN(cfg.Experts)
			}
		}
	}
	return out
}

func noRoute(cfg workloadConfig) [][]int {
	row := make([][]int, cfg.Layers)
	for l := range row {
		row[l] = make([]int, cfg.TopK)
		for k := range row[l] {
			row[l][k] = -1
		}
	}
	return row
}
