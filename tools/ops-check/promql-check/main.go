// promql-check parses PromQL expressions with Prometheus's own parser and reports, for each,
// the parse error or the metric names and label names it selects and groups by. The ops tests
// (tests/ops/test_grafana.py) feed it every expression of the Grafana dashboard.
//
// Input (stdin): a JSON array of strings. Output (stdout): a JSON array, one object per input:
// {"error": "..."} or {"metrics": [...], "matchers": {"metric": ["label", ...]}, "grouping": [...],
// "selectors": [{"metric": "...", "matchers": [["label", "=", "value"], ...]}, ...]}
// (selectors: every vector selector in order, with its matchers' operators and values).
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Error     string              `json:"error,omitempty"`
	Metrics   []string            `json:"metrics"`
	Matchers  map[string][]string `json:"matchers"`
	Grouping  []string            `json:"grouping"`
	Type      string              `json:"type,omitempty"`
	Selectors []selector          `json:"selectors"`
}

type selector struct {
	Metric   string      `json:"metric"`
	Matchers [][3]string `json:"matchers"`
}

var promql = parser.NewParser(parser.Options{})

func check(expr string) result {
	r := result{Metrics: []string{}, Matchers: map[string][]string{}, Grouping: []string{}, Selectors: []selector{}}
	node, err := promql.ParseExpr(expr)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	r.Type = string(node.Type())
	metrics := map[string]bool{}
	grouping := map[string]bool{}
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		switch v := n.(type) {
		case *parser.VectorSelector:
			name := v.Name
			labels := []string{}
			sel := selector{Matchers: [][3]string{}}
			for _, m := range v.LabelMatchers {
				sel.Matchers = append(sel.Matchers, [3]string{m.Name, m.Type.String(), m.Value})
				if m.Name == "__name__" {
					if name == "" {
						name = m.Value
					}
					continue
				}
				labels = append(labels, m.Name)
			}
			metrics[name] = true
			sel.Metric = name
			r.Selectors = append(r.Selectors, sel)
			if _, seen := r.Matchers[name]; !seen {
				r.Matchers[name] = []string{}
			}
			r.Matchers[name] = append(r.Matchers[name], labels...)
		case *parser.AggregateExpr:
			for _, g := range v.Grouping {
				grouping[g] = true
			}
		case *parser.BinaryExpr:
			if v.VectorMatching != nil {
				for _, g := range v.VectorMatching.MatchingLabels {
					grouping[g] = true
				}
			}
		}
		return nil
	})
	for m := range metrics {
		r.Metrics = append(r.Metrics, m)
	}
	for g := range grouping {
		r.Grouping = append(r.Grouping, g)
	}
	sort.Strings(r.Metrics)
	sort.Strings(r.Grouping)
	return r
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-check: stdin must be a JSON array of strings:", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(exprs))
	for _, e := range exprs {
		out = append(out, check(e))
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", " ")
	if err := enc.Encode(out); err != nil {
		os.Exit(2)
	}
}
