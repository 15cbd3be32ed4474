// goproducer: an independent producer of the stage's input topics, written from
// docs/producers.md and docs/schemas.md only (franz-go for Kafka, hamba/avro for Avro).
//
//	goproducer produce -brokers HOST:PORT -staged-topic T -receipts-topic T -routes-topic T -partitions 3 [...]
//	goproducer check -vectors gym_extended_vectors.json -golden gym_golden_vectors.json -doc producers.md
//
// produce writes each call's routes by reference (route chunks first, then the staged calls
// naming them, then the receipts) and prints, as JSON, every group it produced (each
// rollout's expected row) and where each record landed; check verifies the digests against the conformance vectors and the
// doc's worked example. Exit status 1 on any failure.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"hash/crc32"
	"os"
	"time"

	"github.com/hamba/avro/v2"
	"github.com/twmb/franz-go/pkg/kgo"
)

type delivery struct {
	Kind      string `json:"kind"` // chunk, staged or receipt
	Topic     string `json:"topic"`
	Key       string `json:"key"`
	Partition int32  `json:"partition"`
	Offset    int64  `json:"offset"`
}

type report struct {
	Partitioner string       `json:"partitioner"`
	Layers      int          `json:"layers"`
	TopK        int          `json:"topk"`
	Groups      []*groupPlan `json:"groups"`
	Deliveries  []delivery   `json:"deliveries"`
	Misplaced   int          `json:"misplaced"` // records not where murmur2 says (crc32 mode)
}

func main() {
	if len(os.Args) < 2 {
		fail(fmt.Errorf("usage: goproducer produce|check [flags]"))
	}
	var err error
	switch os.Args[1] {
	case "produce":
		err = produce(os.Args[2:])
	case "check":
		err = check(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	fail(err)
}

func fail(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "goproducer:", err)
		os.Exit(1)
	}
}

func produce(args []string) error {
	fs := flag.NewFlagSet("produce", flag.ExitOnError)
	brokers := fs.String("brokers", "", "bootstrap servers")
	stagedTopic := fs.String("staged-topic", "rollouts.staged-calls", "")
	receiptsTopic := fs.String("receipts-topic", "rollouts.receipts", "")
	routesTopic := fs.String("routes-topic", "rollouts.staged-routes", "route chunks (routes by reference)")
	routes := fs.String("routes", "reference", "reference (chunks to -routes-topic, then the calls naming them) or inline")
	chunkBytes := fs.Int("route-chunk-bytes", 4<<20, "route payload bytes per chunk")
	schemaDir := fs.String("schemas", "schemas", "directory of the .avsc files")
	partitions := fs.Int("partitions", 0, "partition count, to check where records landed")
	partitioner := fs.String("partitioner", "murmur2", "murmur2 (the client's default) or crc32 (wrong on purpose)")
	cfg := workloadConfig{}
	fs.StringVar(&cfg.Prefix, "prefix", "gx", "group id prefix")
	fs.IntVar(&cfg.Groups, "groups", 4, "")
	fs.IntVar(&cfg.GroupSize, "group-size", 4, "")
	fs.IntVar(&cfg.Turns, "turns", 3, "calls per rollout (root + children)")
	fs.IntVar(&cfg.Layers, "layers", 2, "")
	fs.IntVar(&cfg.TopK, "topk", 2, "")
	fs.IntVar(&cfg.Experts, "experts", 64, "expert count (64: int8 routes)")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "")
	fs.StringVar(&cfg.Tamper, "tamper", "", "boundary | token: corrupt one rollout per group")
	fs.Parse(args)
	if *partitions <= 0 || *brokers == "" {
		return fmt.Errorf("-brokers and -partitions are required")
	}
	if (*routes != "reference" && *routes != "inline") || *chunkBytes < 1 {
		return fmt.Errorf("-routes must be reference or inline, -route-chunk-bytes >= 1")
	}
	sch, err := loadSchemas(*schemaDir)
	if err != nil {
		return err
	}
	opts := []kgo.Opt{kgo.SeedBrokers(*brokers), kgo.ProducerBatchMaxBytes(16 << 20)}
	switch *partitioner {
	case "murmur2": // franz-go's default partitioner hashes keys with Kafka's murmur2
	case "crc32":
		opts = append(opts, kgo.RecordPartitioner(kgo.BasicConsistentPartitioner(
			func(string) func(*kgo.Record, int) int {
				return func(r *kgo.Record, n int) int { return int(crc32.ChecksumIEEE(r.Key) % uint32(n)) }
			})))
	default:
		return fmt.Errorf("unknown partitioner %q", *partitioner)
	}
	client, err := kgo.NewClient(opts...)
	if err != nil {
		return err
	}
	defer client.Close()

	groups := buildWorkload(cfg)
	out := report{Partitioner: *partitioner, Layers: cfg.Layers, TopK: cfg.TopK, Groups: groups}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	// deliver produces a batch and waits for every acknowledgement; each record of the batch
	// then holds its partition and offset (ProduceSync's results come in completion order).
	deliver := func(batch []*kgo.Record, kind string) error {
		for _, res := range client.ProduceSync(ctx, batch...) {
			if res.Err != nil {
				return fmt.Errorf("produce to %s: %w", res.Record.Topic, res.Err)
			}
			r := res.Record
			out.Deliveries = append(out.Deliveries, delivery{kind, r.Topic, string(r.Key), r.Partition, r.Offset})
			if int(r.Partition) != partitionFor(r.Key, *partitions) {
				out.Misplaced++
			}
		}
		return nil
	}
	// Claim-check order: every route chunk acknowledged, then the staged calls naming them,
	// then the receipts naming the staged calls.
	if *routes == "reference" {
		chunks, owners, err := chunkRecords(groups, sch, *routesTopic, *chunkBytes)
		if err != nil {
			return err
		}
		if err := deliver(chunks, "chunk"); err != nil { // no staged call for routes the broker did not take
			return fmt.Errorf("route chunks: %w (no staged call produced)", err)
		}
		if err := reference(owners, chunks, *routesTopic); err != nil {
			return err
		}
	}
	staged, receipts, err := records(groups, cfg, sch, *stagedTopic, *receiptsTopic)
	if err != nil {
		return err
	}
	if err := deliver(staged, "staged"); err != nil {
		return err
	}
	values := stagedValues(groups)
	for i, r := range staged { // a reference names its call's own partition
		if ref := values[i].RoutesRef; ref != nil && ref.Partition != r.Partition {
			return fmt.Errorf("staged call at partition %d names route chunks in partition %d", r.Partition, ref.Partition)
		}
	}
	if err := deliver(receipts, "receipt"); err != nil {
		return err
	}
	if *partitioner == "murmur2" && out.Misplaced > 0 {
		return fmt.Errorf("%d records landed outside their murmur2 partition", out.Misplaced)
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// chunkOwner: the staged call (and the position in its payload) a chunk record belongs to.
type chunkOwner struct {
	call  *stagedCall
	index int
	chunk routeChunk
}

// chunkRecords splits every call's route payload into RouteChunk records, keyed by group id
// like the call (so they land on the same partition number).
func chunkRecords(groups []*groupPlan, sch schemas, topic string, size int) ([]*kgo.Record, []chunkOwner, error) {
	var recs []*kgo.Record
	var owners []chunkOwner
	for _, g := range groups {
		for _, r := range g.Rollouts {
			for _, c := range r.calls {
				if c.value.RoutedExperts == nil {
					continue
				}
				pieces := splitPayload(c.value.RoutedExperts.Data, size)
				for i, p := range pieces {
					value, err := avro.Marshal(sch.chunk, RouteChunk{GroupID: g.GroupID, StagingKey: c.value.StagingKey,
						Index: int32(i), Count: int32(len(pieces)), SHA256: p.sha256, Data: p.data})
					if err != nil {
						return nil, nil, fmt.Errorf("RouteChunk %d of %s: %w", i, c.value.StagingKey, err)
					}
					recs = append(recs, &kgo.Record{Topic: topic, Key: []byte(g.GroupID), Value: value})
					owners = append(owners, chunkOwner{c, i, p})
				}
			}
		}
	}
	return recs, owners, nil
}

// reference sets each call's routes_ref from where its chunks landed (all on one partition,
// offsets in payload order) and takes the payload out of the call.
func reference(owners []chunkOwner, done []*kgo.Record, topic string) error {
	for i, o := range owners {
		c, r := o.call, done[i]
		if o.index == 0 {
			rt := c.value.RoutedExperts
			c.value.RoutesRef = &RouteReference{Topic: topic, Partition: r.Partition, DType: rt.DType, Shape: rt.Shape}
		}
		ref := c.value.RoutesRef
		if r.Offset < 0 { // acknowledged without an offset: producers.md says to send the chunks again
			return fmt.Errorf("route chunk %d of %s was acknowledged without an offset", o.index, c.value.StagingKey)
		}
		if r.Partition != ref.Partition {
			return fmt.Errorf("route chunks of %s landed in partitions %d and %d", c.value.StagingKey, ref.Partition, r.Partition)
		}
		if n := len(ref.Chunks); n > 0 && r.Offset <= ref.Chunks[n-1].Offset {
			return fmt.Errorf("route chunks of %s are not in payload order", c.value.StagingKey)
		}
		ref.Chunks = append(ref.Chunks, RouteChunkRef{Offset: r.Offset, Length: int64(len(o.chunk.data)), SHA256: o.chunk.sha256})
	}
	for _, o := range owners {
		o.call.value.RoutedExperts = nil
	}
	return nil
}

// stagedValues: every staged call, in the order records() encodes them.
func stagedValues(groups []*groupPlan) []*StagedCall {
	var out []*StagedCall
	for _, g := range groups {
		for _, r := range g.Rollouts {
			for _, c := range r.calls {
				out = append(out, &c.value)
			}
		}
	}
	return out
}

// records encodes every staged call and receipt event, keyed by group id (the client picks
// the partition from the key).
func records(groups []*groupPlan, cfg workloadConfig, sch schemas, stagedTopic, receiptsTopic string) (
	staged, receipts []*kgo.Record, err error) {
	for _, g := range groups {
		key := []byte(g.GroupID)
		for _, r := range g.Rollouts {
			for _, c := range r.calls {
				value, err := avro.Marshal(sch.staged, c.value)
				if err != nil {
					return nil, nil, fmt.Errorf("StagedCall %s: %w", c.value.StagingKey, err)
				}
				staged = append(staged, &kgo.Record{Topic: stagedTopic, Key: key, Value: value})
			}
			event := ReceiptEvent{GroupID: g.GroupID, RolloutID: r.RolloutID, RolloutIndex: int32(r.RolloutIndex),
				GroupSize: int32(cfg.GroupSize), PromptIdx: 7, Reward: float64(r.RolloutIndex % 2),
				LossMultiplier: 1.0, Labels: []GroupLabel{}, ResultStats: []ResultStat{}}
			if r.HasReceipt {
				event.Receipt = r.receipt
			}
			value, err := avro.Marshal(sch.receipt, event)
			if err != nil {
				return nil, nil, fmt.Errorf("ReceiptEvent %s: %w", r.RolloutID, err)
			}
			receipts = append(receipts, &kgo.Record{Topic: receiptsTopic, Key: key, Value: value})
		}
	}
	return staged, receipts, nil
}
