package main

// `goproducer check`: this producer's digests against the conformance vectors, its murmur2
// against docs/producers.md's table, and its staging against the doc's worked example.

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
)

type checker struct {
	checked  int
	failures []string
}

func (c *checker) eq(what, got, want string) {
	c.checked++
	if got != want {
		c.failures = append(c.failures, fmt.Sprintf("%s: got %s, want %s", what, got, want))
	}
}

func check(args []string) error {
	fs := flag.NewFlagSet("check", flag.ExitOnError)
	vectors := fs.String("vectors", "", "gym_extended_vectors.json")
	golden := fs.String("golden", "", "gym_golden_vectors.json")
	doc := fs.String("doc", "", "docs/producers.md")
	fs.Parse(args)
	c := &checker{}
	for _, step := range []struct {
		path string
		run  func(*checker, map[string]any)
	}{{*vectors, checkVectors}, {*golden, checkGolden}} {
		v, err := readJSON(step.path)
		if err != nil {
			return err
		}
		step.run(c, v.(map[string]any))
	}
	if err := checkWorkedExample(c, *doc); err != nil {
		return err
	}
	checkMurmur2(c)
	json.NewEncoder(os.Stdout).Encode(map[string]any{"checked": c.checked, "failures": c.failures})
	if len(c.failures) > 0 {
		return fmt.Errorf("%d of %d checks failed", len(c.failures), c.checked)
	}
	return nil
}

// readJSON keeps JSON's integer/float distinction: a number with '.', 'e' or 'E' is a float.
func readJSON(path string) (any, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	return typed(v), nil
}

func typed(v any) any {
	switch x := v.(type) {
	case json.Number:
		if strings.ContainsAny(string(x), ".eE") {
			f, _ := strconv.ParseFloat(string(x), 64)
			return f
		}
		if i, err := strconv.ParseInt(string(x), 10, 64); err == nil {
			return i
		}
		u, _ := strconv.ParseUint(string(x), 10, 64) // u64 token ids and weight versions
		return u
	case []any:
		for i := range x {
			x[i] = typed(x[i])
		}
	case map[string]any:
		for k := range x {
			x[k] = typed(x[k])
		}
	}
	return v
}

func asU64(v any) uint64 {
	if u, ok := v.(uint64); ok {
		return u
	}
	return uint64(v.(int64))
}

func u64s(v any) []uint64 {
	var out []uint64
	for _, x := range v.([]any) {
		out = append(out, asU64(x))
	}
	return out
}

func floats(v any) []float64 {
	var out []float64
	for _, x := range v.([]any) {
		out = append(out, x.(float64))
	}
	return out
}

func optString(v any) *string {
	if v == nil {
		return nil
	}
	s := v.(string)
	return &s
}

func stagedDigest(s map[string]any) string {
	return callDigest(call{RolloutID: s["rollout_id"].(string), ModelCallID: s["model_call_id"].(string),
		ParentCallID: optString(s["parent_call_id"]), Mode: s["mode"].(string), PrevLen: asU64(s["prev_len"]),
		DeltaLen: asU64(s["delta_len"]), CumLen: asU64(s["cum_len"]), WeightVersion: asU64(s["weight_version"]),
		TokenIDs: u64s(s["token_ids_delta"]), Mask: floats(s["token_mask_delta"]),
		LogProbs: floats(s["generation_log_probs_delta"]), ExtrasDigest: s["extras_digest"].(string),
		ChainHash: s["chain_hash"].(string), CumulativeHash: s["cumulative_hash"].(string)})
}

func checkVectors(c *checker, v map[string]any) {
	for i, e := range v["extras"].([]any) {
		e := e.(map[string]any)
		c.eq(fmt.Sprintf("extras[%d]", i), extrasDigest(e["extras"]), e["digest"].(string))
	}
	for i, e := range v["hash_token_ids"].([]any) {
		e := e.(map[string]any)
		c.eq(fmt.Sprintf("hash_token_ids[%d]", i), cumulativeHash(u64s(e["token_ids"])), e["hash"].(string))
	}
	for i, e := range v["chain_hash"].([]any) {
		e := e.(map[string]any)
		parent, _ := e["parent_chain_hash"].(string)
		c.eq(fmt.Sprintf("chain_hash[%d]", i), chainHash(parent, u64s(e["token_ids_delta"])), e["chain_hash"].(string))
	}
	for i, e := range v["staged_calls"].([]any) {
		e := e.(map[string]any)
		c.eq(fmt.Sprintf("staged_calls[%d]", i), stagedDigest(e), e["digest"].(string))
	}
	for i, e := range v["routes"].([]any) {
		e := e.(map[string]any)
		var rt routes
		for _, token := range e["values"].([]any) {
			var layers [][]int
			for _, layer := range token.([]any) {
				var experts []int
				for _, x := range layer.([]any) {
					experts = append(experts, int(x.(int64)))
				}
				layers = append(layers, experts)
			}
			rt = append(rt, layers)
		}
		c.eq(fmt.Sprintf("routes[%d]", i), rt.envelope(e["dtype"].(string)), e["envelope"].(string))
	}
}

func checkGolden(c *checker, v map[string]any) {
	c.eq("golden extras", extrasDigest(v["extras"]), v["extras_digest"].(string))
	c.eq("golden staged call", stagedDigest(v["staged_call"].(map[string]any)), v["staged_call_digest"].(string))
}

// checkWorkedExample stages the rollout of docs/producers.md section 8, as its prose describes
// it, and compares every value of the example's block.
func checkWorkedExample(c *checker, path string) error {
	want, err := exampleBlock(path)
	if err != nil {
		return err
	}
	b := newRollout("g-doc", "g-doc-r0")
	r0 := routes{{{1, 2}}, {{3, 4}}, {{5, 6}}, {{7, 8}}, {{-1, -1}}}
	b.stage("c0", "", []uint64{1, 2, 3}, []uint64{4, 5}, []float64{-0.5, -0.25}, 7, r0, nil, "int8")
	r1 := routes{{{9, 10}}, {{11, 12}}, {{-1, -1}}}
	b.stage("c1", "c0", []uint64{6}, []uint64{7, 8}, []float64{-1.0, -0.125}, 8, r1, routes{{{13, 14}}}, "int8")
	for _, id := range []string{"c0", "c1"} {
		s := b.calls[id]
		extras := map[string]any{"routed_experts": s.routes.envelope("int8")}
		got := map[string]string{
			"prev_len": fmt.Sprint(s.value.PrevLen), "delta_len": fmt.Sprint(s.value.DeltaLen),
			"cum_len": fmt.Sprint(s.value.CumLen), "routed_experts": s.routes.envelope("int8"),
			"extras_metadata_json": s.value.ExtrasMetadataJSON, "extras_digest": s.value.ExtrasDigest,
			"chain_hash": s.value.ChainHash, "cumulative_hash": s.value.CumulativeHash, "digest": s.value.Digest,
		}
		if s.boundary != nil {
			got["routed_experts_boundary"] = s.boundary.envelope("int8")
			extras["routed_experts_boundary"] = got["routed_experts_boundary"]
			extras["routed_experts_boundary_index"] = s.value.PrevLen - 1
		}
		got["extras_payload"] = hex.EncodeToString(extrasPayload(extras))
		for name, value := range got {
			key := id + "." + name
			if _, ok := want[key]; !ok {
				return fmt.Errorf("%s: the worked example does not state %s", path, key)
			}
			c.eq("worked example "+key, value, want[key])
			delete(want, key)
		}
	}
	for key := range want {
		c.failures = append(c.failures, "worked example states "+key+", which this producer does not compute")
	}
	return nil
}

// exampleBlock reads the `name = value` lines of the fenced block that starts with
// "# worked example".
func exampleBlock(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	out, inside := map[string]string{}, false
	for sc := bufio.NewScanner(f); sc.Scan(); {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "# worked example"):
			inside = true
		case inside && strings.HasPrefix(line, "```"):
			return out, nil
		case inside:
			name, value, ok := strings.Cut(line, " = ")
			if !ok {
				return nil, fmt.Errorf("%s: worked example line %q is not `name = value`", path, line)
			}
			out[name] = value
		}
	}
	return nil, fmt.Errorf("%s: no worked example block", path)
}

// checkMurmur2: the table of docs/producers.md section 1 (key, signed murmur2, of 3, of 12).
func checkMurmur2(c *checker) {
	for _, v := range []struct {
		key       string
		hash      int32
		of3, of12 int
	}{
		{"21", -973932308, 0, 0}, {"foobar", -790332482, 0, 6},
		{"a-little-bit-long-string", -985981536, 2, 8}, {"a-little-bit-longer-string", -1486304829, 2, 11},
		{"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971, 2, 5},
		{"abc", 479470107, 0, 3}, {"g-doc", -2045225422, 1, 10}, {"é", 186971271, 0, 3},
	} {
		key := []byte(v.key)
		c.eq("murmur2 "+v.key, fmt.Sprint(int32(murmur2(key))), fmt.Sprint(v.hash))
		c.eq("partition of 3 "+v.key, fmt.Sprint(partitionFor(key, 3)), fmt.Sprint(v.of3))
		c.eq("partition of 12 "+v.key, fmt.Sprint(partitionFor(key, 12)), fmt.Sprint(v.of12))
	}
}
