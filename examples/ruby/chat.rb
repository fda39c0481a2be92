#!/usr/bin/env ruby
# frozen_string_literal: true

# One chat turn against a pagedserve router, streamed: the router renders the conversation with
# the model's chat template (GenerateRequest.messages) and streams the answer.
#
#   apt-get install ruby-grpc ruby-grpc-tools   # Debian 12: grpc 1.51, protoc 3.21
#   rake                                        # generates lib/ from the .proto files
#   ruby chat.rb HOST:PORT "Name a colour." [--system TEXT] [--max-tokens N] [--temperature T]
#
# Prints the answer as it streams, then one line "[finish_reason: P prompt tokens, C generated]".
# A failed call prints "CODE: message" on stderr, then one line per google.rpc detail
# ("  field F: description" for a BadRequest, "  retry after S s" for a RetryInfo), exits 1.

$LOAD_PATH.unshift(File.join(__dir__, 'lib'))
require 'optparse'
require 'grpc'
require 'google/protobuf/well_known_types' # Any#unpack
require 'google/rpc/error_details_pb'
require 'google/rpc/status_pb'
require 'pagedserve/v1/generation_services_pb'

V1 = Pagedserve::V1

USAGE = 'usage: ruby chat.rb HOST:PORT QUESTION [--system TEXT] [--max-tokens N]'

def parse_args(argv)
  args = { system: nil, max_tokens: 64, temperature: 0.0 }
  OptionParser.new do |opts|
    opts.banner = USAGE
    opts.on('--system TEXT') { |v| args[:system] = v }
    opts.on('--max-tokens N', Integer) { |v| args[:max_tokens] = v }
    opts.on('--temperature T', Float) { |v| args[:temperature] = v }
  end.parse!(argv)
  abort(USAGE) unless argv.size == 2
  args.merge(address: argv[0], question: argv[1])
end

def request_for(args)
  messages = []
  messages << V1::ChatMessage.new(role: 'system', content: args[:system]) if args[:system]
  messages << V1::ChatMessage.new(role: 'user', content: args[:question])
  sampling = V1::SamplingParams.new(temperature: args[:temperature], max_tokens: args[:max_tokens])
  V1::GenerateRequest.new(
    messages: V1::ChatMessages.new(messages: messages), # the `prompt` oneof: set exactly one
    add_generation_prompt: true,
    sampling: sampling,
    stream: true # NOTE: false by default: one message when the whole answer is done
  )
end

# The status of a failed call and its google.rpc details (from the grpc-status-details-bin
# trailer), one line each, on stderr.
def print_error(error)
  codes = GRPC::Core::StatusCodes
  code = codes.constants.find { |name| codes.const_get(name) == error.code }
  warn "#{code || error.code}: #{error.details}"
  (error.to_rpc_status&.details || []).each do |any|
    if (bad_request = any.unpack(Google::Rpc::BadRequest))
      bad_request.field_violations.each { |v| warn "  field #{v.field}: #{v.description}" }
    elsif (retry_info = any.unpack(Google::Rpc::RetryInfo))
      delay = retry_info.retry_delay
      warn "  retry after #{delay.seconds + delay.nanos / 1e9} s"
    end
  end
end

def main
  args = parse_args(ARGV.dup)
  stub = V1::Generation::Stub.new(args[:address], :this_channel_is_insecure)
  last = nil
  stub.generate(request_for(args)).each do |response|
    $stdout.write(response.text)
    $stdout.flush
    last = response
  end
  return if last.nil?

  reason = last.finish_reason.to_s.delete_prefix('FINISH_REASON_').downcase
  usage = last.usage
  puts "\n[#{reason}: #{usage.prompt_tokens} prompt tokens, #{usage.completion_tokens} generated]"
rescue GRPC::BadStatus => e
  print_error(e)
  exit 1
end

main
