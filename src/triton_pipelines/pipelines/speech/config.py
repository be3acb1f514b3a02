"""The speech pipeline's constants: Whisper's audio and text geometry, the audio limits, the
languages and tasks, the request defaults, and the parameters the builder writes into the models'
configs (``CONFIG_PARAMETERS``)."""

from __future__ import annotations

from triton_pipelines.limits import MAX_AUDIO_BYTES, MAX_AUDIO_SECONDS


SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SECONDS = 30
WINDOW_SAMPLES = WINDOW_SECONDS * SAMPLE_RATE  # 480000
N_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000
# Whisper's text context is 448 positions; 4 go to the prompt.
MAX_TARGET_POSITIONS = 448
PROMPT_LENGTH = 4
# Decoding work is channels × rate × seconds, read from the header before decoding: 300 s of 48 kHz
# stereo. A small FLAC of 8 channels at 192 kHz would otherwise decode to GBs.
MAX_DECODED_SAMPLES = 300 * 48000 * 2
# A request's cost must follow from what it carries, not from what its header declares:
# - the sample rate may not be below telephone band (8 kHz): a 644-byte WAV at 1 Hz declared 300 s
#   and was resampled to 4.8 M samples, 10 Whisper windows (17 s of compute);
# - only the formats we document (libsndfile reads many more: AIFF, CAF, XI, PAF, ... parsers we
#   have no reason to expose): WAV (also WAVEX, RF64), FLAC, OGG (Vorbis, Opus);
# - windows that are digital silence (peak-to-peak under SILENCE_PEAK_TO_PEAK, ~4 LSB of 16-bit
#   audio: nothing to hear) are not decoded: a few KB of FLAC or Vorbis silence declaring 300 s
#   costs one window, not ten. A clip that is silent throughout keeps its first window.
MIN_SAMPLE_RATE = 8000
AUDIO_FORMATS = ("WAV", "WAVEX", "RF64", "FLAC", "OGG")
SILENCE_PEAK_TO_PEAK = 2.0 ** -13
# Decoded and downmixed a block at a time: memory stays at the mono signal's size.
DECODE_BLOCK_FRAMES = 1 << 18

# openai-whisper's LANGUAGES keys, in token order (large-v3 adds "yue": 100 languages).
LANGUAGE_CODES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur "
    "hr bg lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si "
    "km sn yo so af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln "
    "ha ba jw su yue"
).split()
# Each code's English name (openai-whisper's LANGUAGES; OpenAI's verbose_json reports these, lower case).
LANGUAGE_NAMES = dict(pair.replace("_", " ").split("=") for pair in (
    "en=english zh=chinese de=german es=spanish ru=russian ko=korean fr=french ja=japanese "
    "pt=portuguese tr=turkish pl=polish ca=catalan nl=dutch ar=arabic sv=swedish it=italian "
    "id=indonesian hi=hindi fi=finnish vi=vietnamese he=hebrew uk=ukrainian el=greek ms=malay "
    "cs=czech ro=romanian da=danish hu=hungarian ta=tamil no=norwegian th=thai ur=urdu hr=croatian "
    "bg=bulgarian lt=lithuanian la=latin mi=maori ml=malayalam cy=welsh sk=slovak te=telugu "
    "fa=persian lv=latvian bn=bengali sr=serbian az=azerbaijani sl=slovenian kn=kannada et=estonian "
    "mk=macedonian br=breton eu=basque is=icelandic hy=armenian ne=nepali mn=mongolian bs=bosnian "
    "kk=kazakh sq=albanian sw=swahili gl=galician mr=marathi pa=punjabi si=sinhala km=khmer sn=shona "
    "yo=yoruba so=somali af=afrikaans oc=occitan ka=georgian be=belarusian tg=tajik sd=sindhi "
    "gu=gujarati am=amharic yi=yiddish lo=lao uz=uzbek fo=faroese ht=haitian_creole ps=pashto "
    "tk=turkmen nn=nynorsk mt=maltese sa=sanskrit lb=luxembourgish my=myanmar bo=tibetan tl=tagalog "
    "mg=malagasy as=assamese tt=tatar haw=hawaiian ln=lingala ha=hausa ba=bashkir jw=javanese "
    "su=sundanese yue=cantonese").split())
TASKS = ("transcribe", "translate")
# What a request that names no language, task or max_new_tokens gets: the language is detected
# (from the first window's language-token logits, as Whisper does), also when it names "auto".
AUTO_LANGUAGE = "auto"
DEFAULT_LANGUAGE = AUTO_LANGUAGE
# Timestamps per request (input "timestamps"): none (the <|notimestamps|> prompt, the default),
# segment (Whisper's timestamp tokens: segments with real times), word (segments, and each word's
# times from the alignment heads' cross-attention: one decoder call more per window).
TIMESTAMP_MODES = ("none", "segment", "word")
DEFAULT_TIMESTAMPS = "none"
DEFAULT_TASK = "transcribe"
DEFAULT_MAX_NEW_TOKENS = 224
# Voice activity detection (Silero VAD, speech.vad), per item, one of VAD_MODES:
#   off      no VAD: only windows of digital silence are skipped;
#   windows  the clip's usual windows (cut in pauses), decoded only where VAD finds speech: no words
#            from noise or silence, and a window with speech is decoded as without VAD (the same
#            times and tokens);
#   pack     only the speech, packed back to back into windows at speech boundaries (faster-whisper's
#            BatchedInferencePipeline): fewer windows for long audio with pauses, but a pause of 2 s
#            or more is shorter in the audio Whisper times, so the segments around it may touch.
# A request's vad_filter input: true → pack, false → off; without it, DEFAULT_VAD_MODE (the config
# parameter vad_mode). docs/speech.md measures each.
VAD_MODES = ("off", "windows", "pack")
VAD_FILTER_MODES = {True: "pack", False: "off"}
DEFAULT_VAD_MODE = "windows"

# The parameters the builder writes into the Python models' config.pbtxt (the sources name none of
# them): these constants are the one place each value lives (docs/design.md, "Change a limit").
_AUDIO_LIMITS = {"max_audio_seconds": MAX_AUDIO_SECONDS, "max_audio_bytes": MAX_AUDIO_BYTES,
                 "max_decoded_samples": MAX_DECODED_SAMPLES, "min_sample_rate": MIN_SAMPLE_RATE}
_DECODE_DEFAULTS = {"default_language": DEFAULT_LANGUAGE, "default_task": DEFAULT_TASK,
                    "default_timestamps": DEFAULT_TIMESTAMPS, "max_new_tokens": DEFAULT_MAX_NEW_TOKENS}
_VAD_DEFAULT = {"vad_mode": DEFAULT_VAD_MODE}
CONFIG_PARAMETERS = {
    "audio_features": {**_AUDIO_LIMITS, **_VAD_DEFAULT},
    "whisper_decode": _DECODE_DEFAULTS,
    "speech_recognition_stream": {**_DECODE_DEFAULTS, **_AUDIO_LIMITS, **_VAD_DEFAULT},  # both steps in one model
}
