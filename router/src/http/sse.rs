//! Server-sent events in the OpenAI style: each chunk is one `data: {json}` event (named, as
//! `event: response.output_text.delta`, where the endpoint names its events), the stream ends
//! with `data: [DONE]` (unless the endpoint's last event says it ended), and a generation that
//! fails after the response began ends the stream with an error object (then `[DONE]`).

use std::convert::Infallible;

use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::{self, BoxStream, StreamExt};

use super::errors::ApiError;
use super::generation::ChoiceEvent;

/// One server-sent event: its JSON, and its name where the endpoint names events.
pub struct SseChunk {
    pub event: Option<&'static str>,
    pub data: String,
}

impl From<String> for SseChunk {
    fn from(data: String) -> SseChunk {
        SseChunk { event: None, data }
    }
}

/// Turns choice events into the JSON chunks of one endpoint.
pub trait ChunkWriter: Send + 'static {
    /// A chunk: a JSON string (an unnamed event), or an [`SseChunk`].
    type Chunk: Into<SseChunk> + From<String> + Send + 'static;
    /// Whether the stream ends with `data: [DONE]` (the Responses API's streams end with their
    /// `response.completed` event instead).
    const ENDS_WITH_DONE: bool = true;
    /// Chunks sent before any generated text (chat's role deltas).
    fn start(&mut self) -> Vec<Self::Chunk>;
    /// Chunks for one event (possibly none). `Failed` never reaches the writer.
    fn on_event(&mut self, event: ChoiceEvent) -> Vec<Self::Chunk>;
    /// Chunks after every choice finished (the usage chunk).
    fn finish(&mut self) -> Vec<Self::Chunk>;
    /// The chunks that end a stream whose generation failed: the endpoint's error object
    /// (by default OpenAI's, as an unnamed event).
    fn failed(&mut self, error: &ApiError) -> Vec<Self::Chunk> {
        vec![serde_json::to_string(&error.body())
            .expect("error bodies serialize")
            .into()]
    }
}

const DONE: &str = "[DONE]";

fn chunks<C: Into<SseChunk>>(chunks: Vec<C>) -> Vec<SseChunk> {
    chunks.into_iter().map(Into::into).collect()
}
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(15);

struct Driver<W> {
    events: BoxStream<'static, ChoiceEvent>,
    writer: W,
    started: bool,
}

async fn next_chunks<W: ChunkWriter>(
    mut d: Driver<W>,
) -> Option<(Vec<SseChunk>, Option<Driver<W>>)> {
    if !d.started {
        d.started = true;
        return Some((chunks(d.writer.start()), Some(d)));
    }
    loop {
        match d.events.next().await {
            Some(ChoiceEvent::Failed(error)) => {
                // Dropping `d` here aborts the other choices of this response.
                let mut out = chunks(d.writer.failed(&error));
                if W::ENDS_WITH_DONE {
                    out.push(DONE.to_owned().into());
                }
                return Some((out, None));
            }
            Some(event) => {
                let out = d.writer.on_event(event);
                if !out.is_empty() {
                    return Some((chunks(out), Some(d)));
                }
            }
            None => {
                let mut out = chunks(d.writer.finish());
                if W::ENDS_WITH_DONE {
                    out.push(DONE.to_owned().into());
                }
                return Some((out, None));
            }
        }
    }
}

pub fn sse_response<W: ChunkWriter>(
    events: BoxStream<'static, ChoiceEvent>,
    writer: W,
) -> Response {
    let driver = Driver {
        events,
        writer,
        started: false,
    };
    let chunks = stream::unfold(
        Some(driver),
        |driver| async move { next_chunks(driver?).await },
    )
    .flat_map(|chunks| {
        stream::iter(chunks.into_iter().map(|chunk| {
            // The name first: an event's lines go out in the order they are set.
            let event = match chunk.event {
                Some(name) => Event::default().event(name),
                None => Event::default(),
            };
            Ok::<_, Infallible>(event.data(chunk.data))
        }))
    });
    // Comment lines while a request waits in the queue or prefills keep proxies from closing
    // an idle connection; SSE clients ignore them.
    Sse::new(chunks)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE_INTERVAL))
        .into_response()
}

/// Serializes a chunk; our response types always serialize.
pub fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("response types serialize")
}
