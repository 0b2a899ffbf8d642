"""Built-in training text for the default model's byte-level BPE tokenizer.

Varied English prose, dialogue, code, numbers and some non-ASCII (accented
Latin, Greek, Cyrillic, CJK, emoji) so the trained vocabulary has realistic
merges, including tokens that hold whole multi-byte characters and tokens that
hold only part of one. Changing this text changes the default model's
tokenizer (and therefore its files); treat it as frozen data.
"""

from __future__ import annotations

CORPUS: tuple[str, ...] = (
    """The quick brown fox jumps over the lazy dog. A journey of a thousand miles
begins with a single step. It was the best of times, it was the worst of times,
it was the age of wisdom, it was the age of foolishness. All happy families are
alike; each unhappy family is unhappy in its own way. Call me Ishmael. In the
beginning the Universe was created. This has made a lot of people very angry and
been widely regarded as a bad move.""",
    """Once upon a time there was a small village at the edge of a great forest.
The people of the village were farmers and weavers, and every autumn they held a
festival to celebrate the harvest. Children ran between the stalls, musicians
played old songs, and the smell of fresh bread and roasted apples filled the air.
One year, a stranger arrived on the evening of the festival. She carried a
wooden box under her arm and said she had come from a city far to the south.
"What is in the box?" asked a boy. "Stories," she said, "and each one is true."
That night she opened the box, and the whole village gathered to listen.""",
    """Weather report: Today will be mostly sunny with a high of 24 degrees and
a light breeze from the west. Tomorrow, clouds will move in during the morning
and there is a 60 percent chance of rain in the afternoon. The weekend looks
cooler, with temperatures between 12 and 18 degrees, and strong winds along the
coast. Drivers should expect fog in the valleys early on Saturday.""",
    """Recipe for a simple tomato soup. Ingredients: two tablespoons of olive oil,
one onion, two cloves of garlic, one kilogram of ripe tomatoes, half a litre of
vegetable stock, salt, pepper and a handful of fresh basil. Method: heat the oil
in a large pan, add the chopped onion and cook slowly until soft. Add the garlic
and cook for one more minute. Add the tomatoes and the stock, bring to the boil
and simmer for twenty minutes. Blend until smooth, season to taste and serve
with the basil leaves on top and a slice of warm bread on the side.""",
    """Science note. Water boils at 100 degrees Celsius at sea level, but at a
lower temperature on a high mountain, because the air pressure is lower. Light
from the Sun takes about eight minutes and twenty seconds to reach the Earth.
The human brain contains roughly 86 billion neurons, and each neuron may connect
to thousands of others. Photosynthesis turns carbon dioxide and water into
sugar and oxygen, using the energy of sunlight. Energy cannot be created or
destroyed, only changed from one form into another.""",
    """History. The printing press, developed in the fifteenth century, made
books cheaper and helped ideas spread across Europe. The steam engine powered
the industrial revolution, moving goods and people faster than ever before. In
the twentieth century, computers grew from machines that filled whole rooms to
devices that fit in a pocket. Each of these changes took decades, and each one
changed how people worked, learned and lived.""",
    """Dialogue.
User: Can you help me plan a trip to the mountains?
Assistant: Of course! How many days do you have, and do you prefer hiking or
relaxing by a lake?
User: Three days, and I would like to hike a little but not too much.
Assistant: Then start with an easy trail on the first day, take the cable car to
the summit on the second, and spend the third day by the lake. Remember to pack
water, a warm jacket and sunscreen.
User: Thank you, that sounds perfect.
Assistant: You're welcome. Have a wonderful trip!""",
    """Programming. A function takes inputs and returns an output. In Python you
might write:

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self) -> int:
        self.count += 1
        return self.count

A list looks like [1, 2, 3] and a dictionary looks like {"key": "value"}. Errors
raise exceptions such as ValueError or KeyError. Tests check that code behaves
as expected: assert add(2, 3) == 5. JSON: {"name": "pdserve", "version": 1,
"tags": ["llm", "serving"], "ok": true, "ratio": 0.75}. Shell: ls -la /tmp &&
echo "done" | grep -v error > out.txt 2>&1.""",
    """Numbers and dates: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256
512 1024 2048 4096 8192 65536. The meeting is on 2024-03-15 at 09:30, and the
invoice total is $1,234.56 (including 20% tax). Call +1 555 0100 or write to
info@example.com. Version 3.11.4 was released; pi is about 3.14159 and e is
about 2.71828. Room 42, floor 7, building B.""",
    """Languages of the world. In French, a café serves croissants and crème
brûlée; the naïve garçon said « très bien » and déjà vu. In German, the
Straße in Zürich leads to a schöne Brücke, and Müller isst Käse und Äpfel. In
Spanish, el niño come jalapeño en la montaña; ¿dónde está la estación? ¡Olé!
In Portuguese, São Paulo e a canção do coração. In Polish, zażółć gęślą jaźń.
In Czech, příliš žluťoučký kůň. In Swedish, Ångström and smörgåsbord. In
Turkish, İstanbul ve güzel ağaçlar. Résumé, façade, piñata, coöperate.""",
    """Greek and Cyrillic. Καλημέρα κόσμε, η γλώσσα είναι ελληνική. Αλφα, βήτα,
γάμμα, δέλτα. Привет, мир! Москва и Санкт-Петербург. Спасибо, до свидания.
Математика: α + β = γ, ∑ x² ≥ 0, ∞ > n, √2 ≈ 1.414, π r², ∂f/∂x, ±5 °C, 10 µm,
→ ← ↑ ↓, € £ ¥ ₹ ©, — … “quotes” ‘single’.""",
    """Chinese and Japanese and Korean. 你好，世界！我们今天去公园散步。中国的首都是北京。
我喜欢读书，也喜欢听音乐。学习语言需要时间和耐心。今天天气很好。你好吗？我很好，谢谢。
日本語：こんにちは、世界。東京は日本の首都です。ありがとうございます。今日はいい天気ですね。
カタカナ：コンピューター、プログラム、サーバー。ひらがな：おはよう、さようなら。
한국어: 안녕하세요, 세계. 서울은 한국의 수도입니다. 감사합니다. 좋은 하루 되세요.
你好你好，世界世界，北京北京，東京東京，안녕하세요 안녕하세요.""",
    """Emoji and symbols. Good morning 🙂 🌞! Launch day 🚀🚀🚀 and the team
says 👍 👍🏽 👏 🎉. I ❤️ pizza 🍕 and coffee ☕. Weather: ☀️ 🌧️ ❄️ 🌈. Family:
👨‍👩‍👧‍👦. Flags: 🇯🇵 🇫🇷 🇧🇷 🇺🇸. Animals: 🐶 🐱 🦊 🐼 🐙. Done ✅, failed ❌,
warning ⚠️. Laughing 😂😂 and thinking 🤔. 🙂🙂 🚀 🍕 ✅ 😂.""",
    """Poem.
The river runs beneath the hill,
the evening air is soft and still;
the lanterns glow, the swallows fly,
and stars come out across the sky.
We walk the road we walked before,
and find the same familiar door,
and someone calls us in to eat,
and bread is warm, and rest is sweet.""",
    """Letter. Dear Sam, thank you for your letter and for the photographs of the
garden. The roses look beautiful, and I was glad to hear that the apple tree
finally gave fruit this year. Here, the winter has been long and grey, but the
days are getting longer and the first birds have returned. I hope to visit in
the spring, perhaps in April, if the trains are running on time. Please give my
best wishes to your family. With love, Alex.""",
    """Business memo. Subject: quarterly results. Revenue grew by 12 percent
compared with the same quarter last year, driven by strong sales in the north
region and a successful product launch in March. Costs rose by 5 percent,
mainly because of higher shipping prices. The board has approved a new
investment in customer support and training. Next steps: review the budget,
hire two engineers, and prepare the annual report before the end of June.""",
    """Questions and answers. What is the capital of France? The capital of
France is Paris. How many legs does a spider have? A spider has eight legs.
Why is the sky blue? Sunlight is scattered by the molecules of the air, and
blue light is scattered more than red light. Who wrote Romeo and Juliet?
William Shakespeare wrote it. When did the first person walk on the Moon? In
1969. Where do penguins live? Most penguins live in the Southern Hemisphere.""",
    """Serving notes. A language model reads a prompt, computes a key and value
cache for every token, and then generates new tokens one at a time. The prefill
stage is limited by compute, while the decode stage is limited by memory
bandwidth. Splitting the two stages across separate workers lets each one scale
on its own. The cache is stored in fixed-size blocks, and a block table maps
each sequence to its blocks. Tokens per second, time to first token and time per
output token are the numbers that operators watch.""",
)


def corpus_text() -> str:
    """The whole corpus as one string (sections separated by blank lines)."""
    return "\n\n".join(CORPUS) + "\n"
