// One chat turn against a pagedserve router, streamed: the router renders the conversation with
// the model's chat template (GenerateRequest.messages) and streams the answer.
//
//	# Debian 12: Go 1.19, grpc-go 1.33, protobuf-go 1.28 (or `make go-grpc`)
//	apt-get install golang-go golang-google-grpc-dev golang-github-golang-protobuf-1-5-dev \
//	  protobuf-compiler protoc-gen-go protoc-gen-go-grpc
//	examples/go/build.sh   # stubs generated from protos/, binary .cache/go/bin/pagedserve-chat
//	.cache/go/bin/pagedserve-chat HOST:PORT "Name a colour." [--system TEXT] [--max-tokens N]
//
// Prints the answer as it streams, then one line "[finish_reason: P prompt tokens, C generated]".
// A failed call prints "CODE: message" on stderr, then one line per google.rpc detail
// ("  field F: description" for a BadRequest, "  retry after S s" for a RetryInfo), exits 1.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"unicode"

	pb "github.com/pagedserve/pagedserve/gen/go/pagedserve/v1"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

const usage = "usage: pagedserve-chat HOST:PORT QUESTION [--system TEXT] [--max-tokens N] [--temperature T]"

type chatArgs struct {
	address, question, system string
	maxTokens                 uint32
	temperature               float32
}

// parseArgs reads the two positional arguments and the flags, in any order.
func parseArgs(argv []string) (chatArgs, error) {
	args := chatArgs{maxTokens: 64}
	var positional []string
	for i := 0; i < len(argv); i++ {
		name := argv[i]
		if !strings.HasPrefix(name, "--") {
			positional = append(positional, name)
			continue
		}
		if i+1 == len(argv) {
			return args, fmt.Errorf("%s needs a value", name)
		}
		value := argv[i+1]
		i++
		switch name {
		case "--system":
			args.system = value
		case "--max-tokens":
			n, err := strconv.ParseUint(value, 10, 32)
			if err != nil {
				return args, fmt.Errorf("--max-tokens: %v", err)
			}
			args.maxTokens = uint32(n)
		case "--temperature":
			t, err := strconv.ParseFloat(value, 32)
			if err != nil {
				return args, fmt.Errorf("--temperature: %v", err)
			}
			args.temperature = float32(t)
		default:
			return args, fmt.Errorf("unknown flag %s", name)
		}
	}
	if len(positional) != 2 {
		return args, fmt.Errorf("want HOST:PORT and QUESTION")
	}
	args.address, args.question = positional[0], positional[1]
	return args, nil
}

func requestFor(args chatArgs) *pb.GenerateRequest {
	var messages []*pb.ChatMessage
	if args.system != "" {
		messages = append(messages, &pb.ChatMessage{Role: "system", Content: args.system})
	}
	messages = append(messages, &pb.ChatMessage{Role: "user", Content: args.question})
	return &pb.GenerateRequest{
		// The `prompt` oneof: set exactly one member.
		Prompt:              &pb.GenerateRequest_Messages{Messages: &pb.ChatMessages{Messages: messages}},
		AddGenerationPrompt: proto.Bool(true),
		// NOTE: optional fields are pointers: unset means the server's default, 0 is a value.
		Sampling: &pb.SamplingParams{
			Temperature: proto.Float32(args.temperature),
			MaxTokens:   proto.Uint32(args.maxTokens),
		},
		Stream: true, // NOTE: false by default: one message when the whole answer is done
	}
}

// codeName writes a gRPC code as the other clients do: InvalidArgument -> INVALID_ARGUMENT.
func codeName(camel string) string {
	var out []rune
	for i, r := range camel {
		if i > 0 && unicode.IsUpper(r) && unicode.IsLower(rune(camel[i-1])) {
			out = append(out, '_')
		}
		out = append(out, unicode.ToUpper(r))
	}
	return string(out)
}

// printError writes the status of a failed call and its google.rpc details (from the
// grpc-status-details-bin trailer), one line each, on stderr.
func printError(err error) {
	st := status.Convert(err)
	fmt.Fprintf(os.Stderr, "%s: %s\n", codeName(st.Code().String()), st.Message())
	for _, detail := range st.Details() {
		switch d := detail.(type) {
		case *errdetails.BadRequest:
			for _, v := range d.GetFieldViolations() {
				fmt.Fprintf(os.Stderr, "  field %s: %s\n", v.GetField(), v.GetDescription())
			}
		case *errdetails.RetryInfo:
			delay := d.GetRetryDelay()
			seconds := float64(delay.GetSeconds()) + float64(delay.GetNanos())/1e9
			fmt.Fprintf(os.Stderr, "  retry after %s s\n", strconv.FormatFloat(seconds, 'f', -1, 64))
		}
	}
}

func chat(args chatArgs) error {
	conn, err := grpc.Dial(args.address, grpc.WithInsecure())
	if err != nil {
		return err
	}
	defer conn.Close()
	stream, err := pb.NewGenerationClient(conn).Generate(context.Background(), requestFor(args))
	if err != nil {
		return err
	}
	var last *pb.GenerateResponse
	for {
		response, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		fmt.Print(response.GetText())
		last = response
	}
	if last == nil {
		return nil
	}
	reason := strings.ToLower(strings.TrimPrefix(last.GetFinishReason().String(), "FINISH_REASON_"))
	usage := last.GetUsage()
	fmt.Printf("\n[%s: %d prompt tokens, %d generated]\n",
		reason, usage.GetPromptTokens(), usage.GetCompletionTokens())
	return nil
}

func main() {
	args, err := parseArgs(os.Args[1:])
	if err != nil {
		fmt.Fprintf(os.Stderr, "%v\n%s\n", err, usage)
		os.Exit(2)
	}
	if err := chat(args); err != nil {
		printError(err)
		os.Exit(1)
	}
}
